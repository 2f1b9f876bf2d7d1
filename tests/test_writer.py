"""The worker's event writer against a real Redis: batched appends, and a Redis that lost its
scripts (a restart, SCRIPT FLUSH) in the middle of a task."""

import asyncio
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from lmsp_core import eventlog, ids, keys, wire
from lmsp_core.settings import Settings
from lmsp_core.tasks import TaskRecord, TaskStore
from tests.support import RedisServer, user_input
from workers.writer import EventWriter, Final, unpack_tokens


class Run:
    def __init__(self, record: TaskRecord, lease: str) -> None:
        self.task_id, self.lease, self.response_id = record.id, lease, record.response_id
        self.fenced = False

    def on_cancel_requested(self) -> None: ...

    def on_fenced(self) -> None:
        self.fenced = True

    def on_final_durable(self) -> None: ...


async def _claimed_task(store: TaskStore) -> tuple[TaskRecord, str]:
    request: dict[str, Any] = {"model": "tiny-unserved", "input": user_input("hi")}
    record = TaskRecord(id=ids.new_id(ids.TASK), model="tiny-unserved", owner="local", kind="task", status="queued",
                        created_at=time.time(), response_id=ids.new_id(ids.RESPONSE),
                        request=wire.encoder.encode(msgspec.convert(request, wire.ResponseRequest)))
    await store.create(record)
    problem = wire.Problem(type="about:blank", title="t", status=500, detail="d", code="c")
    claim = await store.claim(record, "test", "job", "lease-1", problem)
    assert claim.outcome == "claimed"
    return record, "lease-1"


def _delta(run: Run, text: str) -> bytes:
    return wire.encoder.encode(wire.OutputTextDelta(response_id=run.response_id, item_id="msg_1", delta=text))


async def test_appends_survive_a_redis_that_lost_its_scripts(redis_server: RedisServer) -> None:
    redis = aioredis.Redis.from_url(redis_server.url)
    settings = Settings(redis_url=redis_server.url)
    store, writer = TaskStore(redis, settings), EventWriter(redis, settings)
    record, lease = await _claimed_task(store)
    run = Run(record, lease)
    writer.open(run, 0, 0)
    flushing = asyncio.create_task(writer.run())
    try:
        for text in ("a", "b"):
            writer.event(run, wire.TEXT_DELTA, _delta(run, text))
        writer.tokens(run, [1, 2])
        await asyncio.wait_for(writer.settled(run.task_id), 10)
        await redis.script_flush()
        writer.event(run, wire.TEXT_DELTA, _delta(run, "c"))
        writer.tokens(run, [3])
        await asyncio.wait_for(writer.settled(run.task_id), 10)
        events = await eventlog.read_after(redis, record.id, record.response_id, 0)
        assert [(e.id, msgspec.json.decode(e.data)["delta"]) for e in events] == [(1, "a"), (2, "b"), (3, "c")]
        assert not run.fenced
    finally:
        flushing.cancel()
        await redis.aclose()


async def test_a_closed_log_drops_what_its_run_adds_later(redis_server: RedisServer) -> None:
    """A fenced run's engine step that was under way still delivers tokens after the writer closed
    the run's log; they go nowhere, also when the task runs here again (resumed) meanwhile."""
    redis = aioredis.Redis.from_url(redis_server.url)
    settings = Settings(redis_url=redis_server.url)
    store, writer = TaskStore(redis, settings), EventWriter(redis, settings)
    record, lease = await _claimed_task(store)
    fenced, resumed = Run(record, lease), Run(record, lease)
    try:
        writer.open(fenced, 0, 0)
        writer.event(fenced, wire.TEXT_DELTA, _delta(fenced, "lost"))
        writer.close(record.id)
        assert writer.event(fenced, wire.TEXT_DELTA, _delta(fenced, "late")) is None
        writer.tokens(fenced, [9])
        writer.finalize(fenced, Final("completed", b"{}"))
        writer.open(resumed, 0, 0)
        writer.tokens(fenced, [9])
        assert writer.event(resumed, wire.TEXT_DELTA, _delta(resumed, "kept")) == 1
        writer.tokens(resumed, [2])
        await writer.flush()
        events = await eventlog.read_after(redis, record.id, record.response_id, 0)
        assert [(e.id, msgspec.json.decode(e.data)["delta"]) for e in events] == [(1, "kept")]
        assert unpack_tokens(await redis.get(keys.tokens(record.id)) or b"") == [2]
        assert not writer.unsent(record.id)
    finally:
        await redis.aclose()
