"""``Idempotency-Key`` reservations, scoped per principal: which task a key's first request created.

The first request with a key reserves it atomically (``SET NX``) for the task it created, with a
fingerprint of the endpoint and the body; the reservation expires after ``LMSP_IDEMPOTENCY_TTL``.
A repeat with the same fingerprint gets that task (never a second generation, also when repeats
race: exactly one ``SET NX`` wins and the losers drop the records they had prepared before
enqueuing anything); a different fingerprint is ``422 idempotency_key_reused``. The header itself
is the API's (``api.submission.idempotency``).
"""

import hashlib

import msgspec
from redis.asyncio import Redis

from lmsp_core import wire
from lmsp_core.store import keys
from lmsp_core.wire.errors import ServiceUnavailable, Unprocessable

HEADER = "Idempotency-Key"


class Reservation(msgspec.Struct, frozen=True):
    task_id: str
    fingerprint: str


def fingerprint(endpoint: str, request: wire.ResponseRequest) -> str:
    """What must match for a repeat: the endpoint and the request. ``stream`` is left out: it only
    chooses how the answer is delivered, so a repeat may follow the same task either way."""
    # object keys sorted at every level
    canonical = msgspec.json.encode(msgspec.structs.replace(request, stream=False), order="sorted")
    return hashlib.sha256(endpoint.encode() + b"\n" + canonical).hexdigest()


def _key(principal: str, key: str) -> str:
    return keys.idempotency(principal, hashlib.sha256(key.encode()).hexdigest())


def _match(raw: bytes, print_: str) -> str:
    reservation = msgspec.json.decode(raw, type=Reservation)
    if reservation.fingerprint != print_:
        raise Unprocessable(f"This {HEADER} was already used with a different request; use a new key.",
                            code="idempotency_key_reused")
    return reservation.task_id


async def lookup(redis: Redis, principal: str, key: str, print_: str) -> str | None:
    """The task of an earlier request with this key, or None for a new key."""
    raw = await redis.get(_key(principal, key))
    return None if raw is None else _match(raw, print_)


async def reserve(redis: Redis, principal: str, key: str, print_: str, task_id: str, ttl: float) -> str | None:
    """Reserve the key for ``task_id``: None if this call won, else the task of the winner."""
    value = msgspec.json.encode(Reservation(task_id, print_))
    name = _key(principal, key)
    for _ in range(3):  # the winner's reservation may expire between SET NX and GET: try again
        if await redis.set(name, value, nx=True, px=int(ttl * 1000)):
            return None
        raw = await redis.get(name)
        if raw is not None:
            return _match(raw, print_)
    raise ServiceUnavailable(f"The {HEADER} could not be reserved; retry.", retry_after=1)


async def release(redis: Redis, principal: str, key: str, task_id: str) -> None:
    """Drop a reservation whose task could not be queued (only if it is still ours)."""
    name = _key(principal, key)
    raw = await redis.get(name)
    if raw is not None and msgspec.json.decode(raw, type=Reservation).task_id == task_id:
        await redis.delete(name)
