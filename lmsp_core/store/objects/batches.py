"""Batches (OpenAI's Batch API): a file of requests, each valid line a task of the batch's owner.

Everything about a batch lives in Redis under the batch's hash tag, so any API process can drive
it and a restart of any of them loses nothing:

- the batch hash (``keys.batch``): what was asked, its status and timestamps, counters;
- its lines (``keys.batch_lines``): the input file's lines as they were when the batch was
  validated (a list, one entry a line, so line ``n`` is ``LINDEX n``);
- the task of each started line (``keys.batch_tasks``) and the lines whose task has not ended
  (``keys.batch_open``);
- each ended line's output or error line (``keys.batch_results``), written once
  (``scripts.BATCH_RESULT`` counts it in the same step: a line never ends twice).

Batches that need a look are entered in one due index (``keys.batches_due``, server time in ms),
which the drivers of all API processes take from (``api/batches.py``).
"""

import time
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
from redis.asyncio import Redis

from lmsp_core.store import cluster, keys, scripts

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                 "cancelled"]
FINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
Outcome = Literal["completed", "failed"]


class BatchRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Status
    created_at: float
    expires_at: float
    metadata: str | None = None  # JSON
    errors: str | None = None  # JSON: OpenAI's errors object of a batch that failed validation
    total: int = 0
    started: int = 0  # lines before this one have a task or a result
    completed: int = 0
    failed: int = 0
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    trace: str | None = None  # the W3C traceparent of the request that created it: its lines' tasks join it

    @property
    def final(self) -> bool:
        return self.status in FINAL

    @property
    def ended(self) -> int:
        return self.completed + self.failed


def _record(raw: Mapping[bytes, bytes]) -> BatchRecord:
    return msgspec.convert({k.decode(): v.decode() for k, v in raw.items()}, BatchRecord, strict=False)


class BatchStore:
    def __init__(self, redis: Redis, retention: float) -> None:
        self.redis = redis
        self.retention_ms = int(retention * 1000)
        self._result = redis.register_script(scripts.BATCH_RESULT)
        self._move = redis.register_script(scripts.BATCH_MOVE)
        self._add = redis.register_script(scripts.INDEX_ADD)
        self._take = redis.register_script(scripts.INDEX_TAKE)

    async def create(self, record: BatchRecord) -> None:
        mapping = {name: value for name, value in msgspec.structs.asdict(record).items() if value is not None}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.batch(record.id), mapping=mapping)
            pipe.pexpire(keys.batch(record.id), self.retention_ms)
            index = keys.owner_batches(record.owner)
            pipe.zadd(index, {record.id: int(record.created_at * 1000)})
            pipe.pexpire(index, self.retention_ms)
            cluster.evalsha(pipe, self._add, [keys.batches_due()], [record.id, 0])
            await pipe.execute()

    async def get(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        raw = await self.redis.hgetall(keys.batch(batch_id))  # type: ignore[misc]
        if not raw:
            return None
        record = _record(raw)
        return record if owner is None or record.owner == owner else None

    async def list_owned(self, owner: str, limit: int, after: str | None) -> tuple[list[BatchRecord], bool]:
        """An owner's batches, newest first, after the batch ``after``; and whether more follow."""
        index = keys.owner_batches(owner)
        top: float | str = "+inf"
        if after is not None:
            score = await self.redis.zscore(index, after)
            if score is None:
                return [], False
            top = f"({int(score)}"
        ids = await self.redis.zrevrangebyscore(index, top, "-inf", start=0, num=limit + 1)
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.hgetall(keys.batch(batch_id.decode()))
            raws = await pipe.execute()
        records = [_record(raw) for raw in raws if raw]
        return records[:limit], len(records) > limit

    async def move(self, batch_id: str, expected: tuple[str, ...], status: Status, **fields: Any) -> bool:
        """Set the status (and ``fields``) if it is one of ``expected``: the one call that wins a
        transition makes it, however many drivers look at the batch."""
        flat = [str(part) for name, value in fields.items() if value is not None for part in (name, value)]
        return bool(await self._move(keys=[keys.batch(batch_id)], args=[",".join(expected), status, *flat]))

    async def update(self, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(keys.batch(batch_id), mapping={k: v for k, v in fields.items()  # type: ignore[misc]
                                                              if v is not None})

    # --- lines -------------------------------------------------------------------------------------

    async def store_lines(self, batch_id: str, lines: list[bytes]) -> None:
        """The input's lines, replacing what an interrupted validation stored."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.batch_lines(batch_id))
            for start in range(0, len(lines), 1000):
                pipe.rpush(keys.batch_lines(batch_id), *lines[start:start + 1000])
            pipe.pexpire(keys.batch_lines(batch_id), self.retention_ms)
            await pipe.execute()

    async def lines(self, batch_id: str, start: int, stop: int) -> list[bytes]:
        raw: list[bytes] = await self.redis.lrange(keys.batch_lines(batch_id), start, stop - 1)  # type: ignore[misc]
        return raw

    async def started(self, batch_id: str, line: int, task_id: str) -> None:
        """A line's task exists: it is open until its result is stored."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch_tasks(batch_id), str(line), task_id)
            pipe.sadd(keys.batch_open(batch_id), str(line))
            pipe.hset(keys.batch(batch_id), "started", str(line + 1))
            for key in (keys.batch_tasks(batch_id), keys.batch_open(batch_id)):
                pipe.pexpire(key, self.retention_ms)
            await pipe.execute()

    async def skip_to(self, batch_id: str, line: int) -> None:
        await self.redis.hset(keys.batch(batch_id), "started", str(line))  # type: ignore[misc]

    async def open_tasks(self, batch_id: str) -> dict[int, str]:
        """The open lines and their tasks."""
        lines = sorted(int(line) for line in await self.redis.smembers(keys.batch_open(batch_id)))  # type: ignore[misc]
        if not lines:
            return {}
        tasks = await self.redis.hmget(keys.batch_tasks(batch_id), [str(line) for line in lines])  # type: ignore[misc]
        return {line: task.decode() for line, task in zip(lines, tasks, strict=True) if task is not None}

    async def has_result(self, batch_id: str, line: int) -> bool:
        return bool(await self.redis.hexists(keys.batch_results(batch_id), str(line)))  # type: ignore[misc]

    async def end_line(self, batch_id: str, line: int, result: bytes, outcome: Outcome) -> bool:
        """Store a line's result and count it, once; False when it had ended before."""
        stored = (b"+" if outcome == "completed" else b"-") + result
        return bool(await self._result(keys=[keys.batch(batch_id), keys.batch_results(batch_id),
                                             keys.batch_open(batch_id)],
                                       args=[line, stored, outcome, self.retention_ms]))

    async def results(self, batch_id: str) -> tuple[list[bytes], list[bytes]]:
        """The output lines and the error lines, each in line order."""
        raw: dict[bytes, bytes] = await self.redis.hgetall(keys.batch_results(batch_id))  # type: ignore[misc]
        ordered = [raw[line] for line in sorted(raw, key=int)]
        return [value[1:] for value in ordered if value[:1] == b"+"], [value[1:] for value in ordered
                                                                        if value[:1] == b"-"]

    # --- the due index -----------------------------------------------------------------------------

    async def look_at(self, batch_id: str, delay: float) -> None:
        await self._add(keys=[keys.batches_due()], args=[batch_id, int(delay * 1000)])

    async def due(self, limit: int, hold: float) -> list[str]:
        """Up to ``limit`` batches to look at now, each held ``hold`` seconds from other drivers."""
        reply = await self._take(keys=[keys.batches_due()], args=[limit, int(hold * 1000)])
        return [raw.decode() for raw in reply[1:]]

    async def forget(self, batch_id: str) -> None:
        """A final batch needs no more looks; its working sets go, its results and record stay."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(keys.batches_due(), batch_id)
            pipe.delete(keys.batch_lines(batch_id), keys.batch_open(batch_id))
            await pipe.execute()


def now() -> float:
    return time.time()
