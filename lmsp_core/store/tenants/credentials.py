"""Bearer tokens: principals and scopes, stored only as SHA-256 hashes in Redis.

A token is ``lmsp_`` followed by 43 base64url characters (256 random bits). Redis keeps the hash
of the token as the key of its record (``keys.token``) and an index from token id to hash, so
every API process sees a new or revoked token at once. The token itself is shown once, when it
is created, and never stored or logged.

Used by the API (authentication) and by the ``lmsp token`` command (management).
"""

import base64
import hashlib
import re
import secrets
import time
from typing import Annotated

import msgspec
from msgspec import Meta
from redis.asyncio import Redis

from lmsp_core.store import keys
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest

TOKEN_PREFIX = "lmsp_"
TOKEN_ID = "tok"

MODELS_READ = "models:read"
RESPONSES_WRITE = "responses:write"
RESPONSES_READ = "responses:read"
TASKS_WRITE = "tasks:write"
TASKS_READ = "tasks:read"
WEBHOOKS_MANAGE = "webhooks:manage"  # a principal's webhook endpoints and their deliveries
TOOLS_EXECUTE = "tools:execute"  # reserved by LMSP 1.0 (6.5): this service never grants it

GRANTABLE = (MODELS_READ, RESPONSES_WRITE, RESPONSES_READ, TASKS_WRITE, TASKS_READ, WEBHOOKS_MANAGE)
RESERVED = frozenset({TOOLS_EXECUTE})

PRINCIPAL_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
Principal = Annotated[str, Meta(pattern=PRINCIPAL_PATTERN)]


class TokenRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    principal: Principal
    scopes: list[str]
    created_at: float


class Identity(msgspec.Struct, frozen=True):
    """Who a request acts for: the principal (owner of what it creates) and its scopes."""

    principal: str
    scopes: frozenset[str]
    token_id: str | None = None


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()


def parse_scopes(raw: str | list[str]) -> list[str]:
    """Scopes from ``a,b`` or a list; refuses unknown and reserved scopes."""
    wanted = [s.strip() for s in (raw.split(",") if isinstance(raw, str) else raw) if s.strip()]
    if not wanted:
        raise InvalidRequest("At least one scope is needed.", code="invalid_scope")
    for scope in wanted:
        if scope in RESERVED:
            raise InvalidRequest(f"Scope {scope!r} is reserved and is never granted by this service.",
                                 code="invalid_scope")
        if scope not in GRANTABLE:
            raise InvalidRequest(f"Unknown scope {scope!r}; scopes are {', '.join(GRANTABLE)}.",
                                 code="invalid_scope")
    return sorted(set(wanted))


def check_principal(name: str) -> str:
    if not re.fullmatch(PRINCIPAL_PATTERN, name):
        raise InvalidRequest(f"Principal {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -.",
                             code="invalid_principal")
    return name


async def create(redis: Redis, principal: str, scopes: str | list[str]) -> tuple[str, TokenRecord]:
    """A new token for ``principal``: returns the token (shown once) and its record."""
    record = TokenRecord(id=ids.new_id(TOKEN_ID), principal=check_principal(principal),
                         scopes=parse_scopes(scopes), created_at=time.time())
    token = new_token()
    digest = hash_token(token)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(keys.credential(digest), msgspec.json.encode(record))
        pipe.hset(keys.credential_index(), record.id, digest)
        await pipe.execute()
    return token, record


async def authenticate(redis: Redis, token: str) -> Identity | None:
    """The identity of a presented token, or None.

    Constant time with respect to the secret: the presented token is hashed and the hash is looked
    up, so nothing compares secret bytes one by one and the lookup's timing depends only on a hash
    an attacker cannot steer towards a stored one.
    """
    if not token.startswith(TOKEN_PREFIX) or len(token) > 256:
        return None
    raw = await redis.get(keys.credential(hash_token(token)))
    if raw is None:
        return None
    record = msgspec.json.decode(raw, type=TokenRecord)
    # a reserved scope cannot be granted; drop it even if someone wrote it into Redis by hand
    return Identity(record.principal, frozenset(record.scopes) - RESERVED, record.id)


async def list_tokens(redis: Redis) -> list[TokenRecord]:
    index: dict[bytes, bytes] = await redis.hgetall(keys.credential_index())  # type: ignore[misc]
    if not index:
        return []
    raws = await redis.mget([keys.credential(digest.decode()) for digest in index.values()])
    records = [msgspec.json.decode(raw, type=TokenRecord) for raw in raws if raw is not None]
    return sorted(records, key=lambda r: r.created_at)


async def revoke(redis: Redis, token_id: str) -> bool:
    """Revoke a token by id; False if no such token. Takes effect on the next request."""
    digest = await redis.hget(keys.credential_index(), token_id)  # type: ignore[misc]
    if digest is None:
        return False
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.credential(digest.decode()))
        pipe.hdel(keys.credential_index(), token_id)
        await pipe.execute()
    return True
