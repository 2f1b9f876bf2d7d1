"""Priorities: interactive work starts before bulk work queued earlier (docs/protocol.md, "Priorities").

``tiny-serial`` (tests/conftest.py) runs one task at a time on ``variant_worker``: a long task
keeps it busy while the others queue, then is cancelled.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest_asyncio
import redis.asyncio as aioredis

from lmsp_core.settings import load_settings
from lmsp_core.store.tasks import queue
from lmsp_core.store.tasks.records import TaskRecord, TaskStore
from tests.support import Api, Worker, body, sse_events

MODEL = "tiny-serial"


@pytest_asyncio.fixture
async def client(api: Api, variant_worker: Worker) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
        yield http


async def create_task(client: httpx.AsyncClient, **fields: Any) -> str:
    response = await client.post("/lmsp/v1/tasks", json=body(MODEL, **fields))
    assert response.status_code == 202, response.text
    task_id: str = response.json()["id"]
    return task_id


async def status_of(client: httpx.AsyncClient, task_id: str) -> str:
    status: str = (await client.get(f"/lmsp/v1/tasks/{task_id}")).json()["status"]
    return status


async def wait_for(condition: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def first_queue_position(client: httpx.AsyncClient, task_id: str) -> int:
    async for event in sse_events(client, "GET", f"/lmsp/v1/tasks/{task_id}/events?queue_events=true"):
        assert event.event == "task.queued"
        position: int = event.data["queue_position"]
        return position
    raise AssertionError("no task.queued event")


async def record_of_response(store: TaskStore, redis: aioredis.Redis, response_id: str) -> TaskRecord:
    async for key in redis.scan_iter(match="lmsp:task:{*}", count=1000):
        if await redis.type(key) == b"hash" and await redis.hget(key, "response_id") == response_id.encode():
            record = await store.get((await redis.hget(key, "id")).decode())
            assert record is not None
            return record
    raise AssertionError(f"no task for {response_id}")


async def test_high_priority_starts_before_low_priority_queued_earlier(
        client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    store = TaskStore(redis, load_settings())
    blocker = await create_task(client, max_output_tokens=32000)  # cancelled once the others are queued
    await wait_for(lambda: _is(client, blocker, "in_progress"))
    low = [await create_task(client, max_output_tokens=2, extensions={"x-priority": "low"}) for _ in range(10)]
    # a direct response (high priority by default) and a task that asks for it
    direct = asyncio.create_task(client.post("/lmsp/v1/responses", json=body(MODEL, max_output_tokens=2)))
    await wait_for(lambda: _depth_is(redis, 12))
    high = await create_task(client, max_output_tokens=2, extensions={"x-priority": "high"})
    # the queue's order: the direct response, the high task, the running blocker, the low tasks
    assert await first_queue_position(client, high) == 2
    assert await first_queue_position(client, low[0]) == 4
    assert await first_queue_position(client, low[-1]) == 13
    assert await status_of(client, blocker) == "in_progress"  # the worker was busy all along
    await client.post(f"/lmsp/v1/tasks/{blocker}/cancel")
    answer = await direct
    assert answer.status_code == 200
    await wait_for(lambda: _all_final(client, [high, *low]))
    first = await record_of_response(store, redis, answer.json()["id"])
    records = [first, *[await store.get(task_id) for task_id in [high, *low]]]
    starts = [record.started_at for record in records if record is not None]
    assert len(starts) == 12 and all(start is not None for start in starts)
    assert starts == sorted(starts), "tasks started out of priority order"  # low ones in creation order
    assert [record.status for record in records if record is not None] == ["incomplete"] * 12


async def _is(client: httpx.AsyncClient, task_id: str, status: str) -> bool:
    return await status_of(client, task_id) == status


async def _depth_is(redis: aioredis.Redis, depth: int) -> bool:
    return await queue.depth(redis, MODEL) == depth


async def _all_final(client: httpx.AsyncClient, task_ids: list[str]) -> bool:
    statuses = [await status_of(client, task_id) for task_id in task_ids]
    return all(status not in ("queued", "in_progress") for status in statuses)


def test_scores_age() -> None:
    """A low-priority task precedes high-priority work that arrives more than two steps later."""
    step = 300.0
    low = queue.score(1_000_000.0, "low", step)
    assert queue.score(1_000_000.0 + 2 * step - 1, "high", step) < low < queue.score(
        1_000_000.0 + 2 * step + 1, "high", step)
    assert queue.score(1_000_000.0 + step - 1, "normal", step) < low
    assert low == datetime.fromtimestamp(1_000_000.0, tz=UTC)
