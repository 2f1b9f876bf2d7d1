"""Tasks the benchmark writes itself: created through the API on a model no worker serves
(``UNSERVED``) and claimed here as a worker would claim them, so that this process sets the pace of
their events (the fan-out task of ``bench.throughput``, the flushes of ``bench.replication``)."""

import asyncio
import json
from typing import Any

from redis.asyncio import Redis

from bench.report import user_input
from bench.sse import HOST
from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store.tasks.records import ClaimOutcome, TaskRecord, TaskStore
from workers.writer import EventWriter

UNSERVED = "bench-unserved"  # queued on a model no worker serves, written by this process


class BenchRun:
    """The writer's view of a task of our own: this process holds its lease."""

    def __init__(self, task_id: str, lease: str, response_id: str) -> None:
        self.task_id, self.lease, self.response_id = task_id, lease, response_id

    def on_cancel_requested(self) -> None: ...

    def on_fenced(self) -> None:
        raise RuntimeError("the bench lost the lease of its own task")

    def on_final_durable(self) -> None: ...


async def create_task(port: int, model: str = UNSERVED, text: str = "fan-out", **fields: Any) -> dict[str, Any]:
    """Queue a task through the API (``fields``: more of the request's, ``max_output_tokens`` say)."""
    body = json.dumps({"model": model, "input": user_input(text), **fields}).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    raw = await reader.read()
    writer.close()
    result: dict[str, Any] = json.loads(raw.partition(b"\r\n\r\n")[2])
    return result


async def claim_task(redis: Redis, settings: Settings, task_id: str,
                     lease: str) -> tuple[TaskRecord, EventWriter, BenchRun]:
    """Claim the task as a worker would: its record, and a writer with the task's log open for the run."""
    store = TaskStore(redis, settings)
    record = await store.get(task_id)
    assert record is not None
    problem = wire.Problem(type="about:blank", title="x", status=500, code="x", detail="x")
    claim = await store.claim(record, "bench", "bench-job", lease, problem)
    assert claim.outcome is ClaimOutcome.CLAIMED, claim
    run = BenchRun(record.id, lease, record.response_id)
    writer = EventWriter(redis, settings)
    writer.open(run, claim.last_event_id, 0)
    return record, writer, run
