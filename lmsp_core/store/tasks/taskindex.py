"""The index of unfinished tasks that lets workers find tasks nobody is running any more.

One sorted set per model (``keys.active_tasks``): a task enters it when it is created and carries
the time (Redis server time, ms) at which a reaper should next look at it. Reapers take the entries
that are due, read the task hashes (the truth) and schedule the next look, or drop the entry once
the task is final or gone. Stale entries are therefore harmless, and the index is never updated
from the task scripts, which keep to the slot of one task (Redis Cluster).
"""

from collections.abc import Mapping, Sequence

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from lmsp_core.store import cluster, keys, scripts


class ActiveIndex:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._add = redis.register_script(scripts.INDEX_ADD)
        self._take = redis.register_script(scripts.INDEX_TAKE)

    async def add(self, model_id: str, task_id: str, delay_ms: int, *, pipe: Pipeline | None = None) -> None:
        """Look at the task ``delay_ms`` from now (added to ``pipe`` when one is given)."""
        if pipe is None:
            await self._add(keys=[keys.active_tasks(model_id)], args=[task_id, delay_ms])
        else:
            cluster.evalsha(pipe, self._add, [keys.active_tasks(model_id)], [task_id, delay_ms])

    async def take(self, model_id: str, limit: int, hold_ms: int) -> tuple[int, list[str]]:
        """The server time and up to ``limit`` due task ids, held for ``hold_ms`` (other reapers skip
        them meanwhile)."""
        reply = await self._take(keys=[keys.active_tasks(model_id)], args=[limit, hold_ms])
        return int(reply[0]), [raw.decode() for raw in reply[1:]]

    async def settle(self, model_id: str, next_look: Mapping[str, int], drop: Sequence[str]) -> None:
        """Schedule the next look at tasks (server ms; only those still indexed) and drop others."""
        key = keys.active_tasks(model_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            if next_look:
                pipe.zadd(key, dict(next_look), xx=True)
            if drop:
                pipe.zrem(key, *drop)
            await pipe.execute()

    async def entries(self, model_id: str) -> dict[str, int]:
        """Every entry with its next-look time (for tests and diagnostics)."""
        raw = await self.redis.zrange(keys.active_tasks(model_id), 0, -1, withscores=True)
        return {member.decode(): int(score) for member, score in raw}
