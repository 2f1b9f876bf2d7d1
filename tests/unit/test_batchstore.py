"""The batch store's steps against a real Redis: a line ends once, a status moves once."""

import time
import uuid
from collections.abc import AsyncIterator

import pytest_asyncio
import redis.asyncio as aioredis

from lmsp_core.store.objects.batches import BatchRecord, BatchStore
from tests.support import RedisServer


def _record(owner: str = "unit") -> BatchRecord:
    now = time.time()
    return BatchRecord(id=f"batch_{uuid.uuid4().hex}", owner=owner, endpoint="/v1/chat/completions",
                       input_file_id="file_x", completion_window="24h", status="validating", created_at=now,
                       expires_at=now + 60)


async def test_a_line_ends_once_and_is_counted_once(redis: aioredis.Redis) -> None:
    store = BatchStore(redis, 60)
    record = _record()
    await store.create(record)
    await store.started(record.id, 0, "task_a")
    assert await store.open_tasks(record.id) == {0: "task_a"}
    assert await store.end_line(record.id, 0, b'{"ok":1}', "completed")
    assert not await store.end_line(record.id, 0, b'{"again":1}', "failed")  # a second driver's repeat
    assert await store.end_line(record.id, 1, b'{"bad":1}', "failed")
    stored = await store.get(record.id)
    assert stored is not None and (stored.completed, stored.failed, stored.started) == (1, 1, 1)
    assert await store.open_tasks(record.id) == {}
    assert await store.results(record.id) == ([b'{"ok":1}'], [b'{"bad":1}'])


async def test_a_status_moves_only_from_the_one_it_was_read_in(redis: aioredis.Redis) -> None:
    store = BatchStore(redis, 60)
    record = _record()
    await store.create(record)
    assert await store.move(record.id, ("validating",), "in_progress", total=3, in_progress_at=1.5)
    assert not await store.move(record.id, ("validating",), "failed", failed_at=2.0)
    assert await store.move(record.id, ("validating", "in_progress"), "cancelling", cancelling_at=3.0)
    stored = await store.get(record.id)
    assert stored is not None and stored.status == "cancelling" and stored.total == 3
    assert (stored.in_progress_at, stored.failed_at, stored.cancelling_at) == (1.5, None, 3.0)
    assert not await store.move("batch_missing", ("validating",), "failed")


# the session's API processes run batch drivers, which take due batches from the index of their
# database (at times this test's, before it could): the due index is tested in another one
DATABASE = 8


@pytest_asyncio.fixture
async def own_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_server.url.rpartition("/")[0] + f"/{DATABASE}")
    yield connection
    await connection.aclose()


async def test_listing_and_the_due_index(own_redis: aioredis.Redis) -> None:
    store = BatchStore(own_redis, 60)
    owner = f"o-{uuid.uuid4().hex[:8]}"
    made = []
    for _ in range(3):
        made.append(_record(owner))
        await store.create(made[-1])
        time.sleep(0.002)
    first, more = await store.list_owned(owner, 2, None)
    assert [r.id for r in first] == [made[2].id, made[1].id] and more
    rest, more = await store.list_owned(owner, 2, first[-1].id)
    assert [r.id for r in rest] == [made[0].id] and not more
    due = await store.due(100, hold=30)
    assert {r.id for r in made} <= set(due)
    assert not {r.id for r in made} & set(await store.due(100, hold=30))  # held from other drivers
    for record in made:
        await store.forget(record.id)
