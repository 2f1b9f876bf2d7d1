"""Tasks for the unit tests, made through the task store as the API and a worker would: created,
claimed under a lease, events written with the append script. Every test uses a model id of its
own, which no worker of the test session serves or reaps."""

import time
import uuid
from typing import Any

import msgspec
import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.store import keys
from lmsp_core.store.tasks.eventstore import Append, AppendReply, EventStore
from lmsp_core.store.tasks.records import Claim, ClaimOutcome, TaskRecord, TaskStore
from lmsp_core.wire import ids
from tests.support import user_input

FAILURE = wire.Problem(type="about:blank", title="Worker lost", status=500, detail="gave up", code="worker_lost")


def model_id() -> str:
    return f"unit-{uuid.uuid4().hex[:8]}"


async def new_task(store: TaskStore, model: str, **request: Any) -> TaskRecord:
    body = {"model": model, "input": user_input("hi"), **request}
    record = TaskRecord(id=ids.new_id(ids.TASK), model=model, owner="unit", kind="task", status="queued",
                        created_at=time.time(), response_id=ids.new_id(ids.RESPONSE),
                        request=wire.encoder.encode(msgspec.convert(body, wire.ResponseRequest)))
    await store.create(record)
    return record


async def claim(store: TaskStore, record: TaskRecord, lease: str, job: str | None = None) -> Claim:
    return await store.claim(record, "unit-worker", job or keys.job_id(record.id, record.model), lease, FAILURE)


async def claimed(store: TaskStore, record: TaskRecord, lease: str) -> Claim:
    result = await claim(store, record, lease)
    assert result.outcome is ClaimOutcome.CLAIMED, result
    return result


async def lapse(redis: aioredis.Redis, record: TaskRecord) -> None:
    """Let the task's lease lapse at once (its holder stopped renewing it, long enough ago)."""
    await redis.hset(keys.task(record.id), "lease_until", 1)  # type: ignore[misc]


def delta(record: TaskRecord, text: str) -> wire.OutputTextDelta:
    return wire.OutputTextDelta(response_id=record.response_id, item_id="msg_1", delta=text)


def deltas(record: TaskRecord, texts: str) -> tuple[tuple[str, bytes], ...]:
    return tuple((wire.TEXT_DELTA, wire.encoder.encode(delta(record, text))) for text in texts)


async def append(events: EventStore, record: TaskRecord, lease: str, first_id: int, texts: str,
                 token_offset: int, tokens: tuple[int, ...] = (), **fields: Any) -> AppendReply:
    return await events.append(Append(task_id=record.id, response_id=record.response_id, lease=lease,
                                      first_id=first_id, events=deltas(record, texts), token_offset=token_offset,
                                      tokens=tokens, **fields))


class Run:
    """A running task as the writer sees it (``workers.writer.Writable``), noting what it is told."""

    def __init__(self, record: TaskRecord, lease: str) -> None:
        self.task_id, self.lease, self.response_id = record.id, lease, record.response_id
        self.fenced = self.durable = self.cancel_requested = False

    def on_cancel_requested(self) -> None:
        self.cancel_requested = True

    def on_fenced(self) -> None:
        self.fenced = True

    def on_final_durable(self) -> None:
        self.durable = True
