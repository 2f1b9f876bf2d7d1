"""What an operator sets on a principal (a tenant): its weight in the fair share of each model's
queue and its quotas (docs/queue.md, "Fair share between principals").

Kept in one Redis hash (``keys.principals``) beside the credentials, so every API process and
worker sees a change within a second (workers cache the table that long, ``SettingsCache``). A
principal nobody set has weight 1 and no quota. Set with ``lmsp principal set``.
"""

import time
from typing import Annotated

import msgspec
from msgspec import Meta
from redis.asyncio import Redis

from lmsp_core.store import keys
from lmsp_core.store.tenants.credentials import check_principal

Weight = Annotated[float, Meta(gt=0, le=1000)]
Quota = Annotated[int, Meta(ge=1)]


class PrincipalSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    weight: Weight = 1.0
    max_running: Quota | None = None  # per model: its running tasks (a principal at it waits)
    max_queued: Quota | None = None  # per model: its waiting tasks (more: 429 queue_quota_exceeded)

    @property
    def default(self) -> bool:
        return self == DEFAULT


DEFAULT = PrincipalSettings()


async def get(redis: Redis, name: str) -> PrincipalSettings:
    raw = await redis.hget(keys.principals(), name)  # type: ignore[misc]
    return DEFAULT if raw is None else msgspec.json.decode(raw, type=PrincipalSettings)


async def load(redis: Redis) -> dict[str, PrincipalSettings]:
    """Every principal with settings of its own."""
    raw: dict[bytes, bytes] = await redis.hgetall(keys.principals())  # type: ignore[misc]
    return {name.decode(): msgspec.json.decode(value, type=PrincipalSettings) for name, value in raw.items()}


async def store(redis: Redis, name: str, settings: PrincipalSettings) -> None:
    """Replace a principal's settings (the defaults: forget them)."""
    check_principal(name)
    if settings.default:
        await redis.hdel(keys.principals(), name)  # type: ignore[misc]
    else:
        await redis.hset(keys.principals(), name, msgspec.json.encode(settings).decode())  # type: ignore[misc]


CACHE_TTL = 1.0  # seconds a worker's table may lag a change (``SettingsCache``)


class SettingsCache:
    """The principals' settings as a worker reads them for each pick: at most ``ttl`` seconds old."""

    def __init__(self, redis: Redis, ttl: float = CACHE_TTL) -> None:
        self.redis = redis
        self.ttl = ttl
        self._table: dict[str, PrincipalSettings] = {}
        self._read_at = float("-inf")

    async def table(self) -> dict[str, PrincipalSettings]:
        if time.monotonic() - self._read_at >= self.ttl:
            self._table = await load(self.redis)
            self._read_at = time.monotonic()
        return self._table

    def weight(self, name: str) -> float:
        return self._table.get(name, DEFAULT).weight
