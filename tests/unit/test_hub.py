"""The API's event hub against a real Redis: replay, the shared live feed, and the gap filling
between them; every follower gets each event once and in order, whenever it joins."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import redis.asyncio as aioredis

from api.eventhub import EventHub
from lmsp_core import wire
from lmsp_core.store import keys
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire import ids

HEARTBEAT = 0.05


def _record() -> TaskRecord:
    return TaskRecord(id=ids.new_id(ids.TASK), model="unit", owner="unit", kind="task", status="in_progress",
                      created_at=time.time(), response_id=ids.new_id(ids.RESPONSE), request=b"{}")


async def _add(redis: aioredis.Redis, record: TaskRecord, first: int, last: int, final: bool = False) -> None:
    """Store events first..last as a worker does (the last one final if asked)."""
    rid = record.response_id
    async with redis.pipeline(transaction=False) as pipe:
        for number in range(first, last + 1):
            if final and number == last:
                event = wire.ResponseCancelled(response_id=rid, status="cancelled")
                name = wire.CANCELLED
            else:
                event = wire.OutputTextDelta(response_id=rid, item_id="msg_1", delta=str(number))  # type: ignore[assignment]
                name = wire.TEXT_DELTA
            code, data = eventlog.pack(name, wire.encoder.encode(event), rid)
            pipe.xadd(keys.events(record.id), {"event": code, "data": data}, id=eventlog.stream_id(number))
        await pipe.execute()


class Follower:
    """A client following the task from ``after``: the event numbers it got, and its heartbeats."""

    def __init__(self, hub: EventHub, record: TaskRecord, after: int) -> None:
        self.ids: list[int] = []
        self.heartbeats = 0
        self.task = asyncio.create_task(self._follow(hub.follow(record, after)))

    async def _follow(self, batches: AsyncIterator[list[eventlog.Event] | None]) -> None:
        async for batch in batches:
            if batch is None:
                self.heartbeats += 1
                continue
            for event in batch:
                assert msgspec.json.decode(event.data)["response_id"]  # the stored form was unpacked
            self.ids += [event.id for event in batch]

    async def done(self) -> list[int]:
        await asyncio.wait_for(self.task, 10)
        return self.ids


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
async def hub(redis: aioredis.Redis) -> AsyncIterator[EventHub]:
    events = EventHub(redis, HEARTBEAT)
    yield events
    await events.close()


async def test_a_follower_gets_stored_then_live_events_once_in_order(redis: aioredis.Redis, hub: EventHub) -> None:
    record = _record()
    await _add(redis, record, 1, 3)
    follower = Follower(hub, record, 0)
    await _until(lambda: follower.ids == [1, 2, 3])
    await _add(redis, record, 4, 6)
    await _until(lambda: len(follower.ids) == 6)
    await _add(redis, record, 7, 8, final=True)
    assert await follower.done() == list(range(1, 9))
    assert hub.followed_tasks == 0


async def test_a_follower_from_a_cursor_and_one_past_the_end(redis: aioredis.Redis, hub: EventHub) -> None:
    record = _record()
    await _add(redis, record, 1, 5, final=True)
    assert await Follower(hub, record, 2).done() == [3, 4, 5]
    assert await Follower(hub, record, 5).done() == []
    assert await Follower(hub, record, 9).done() == []  # the task ended before the cursor
    assert hub.followed_tasks == 0


async def test_a_long_log_is_replayed_in_chunks(redis: aioredis.Redis, hub: EventHub) -> None:
    record = _record()
    total = 2 * eventlog.READ_CHUNK + 7
    await _add(redis, record, 1, total, final=True)
    assert await Follower(hub, record, 0).done() == list(range(1, total + 1))
    assert await Follower(hub, record, eventlog.READ_CHUNK).done() == list(range(eventlog.READ_CHUNK + 1, total + 1))


async def test_followers_share_one_read_and_heartbeat(redis: aioredis.Redis, hub: EventHub) -> None:
    record = _record()
    await _add(redis, record, 1, 2)
    early, late = Follower(hub, record, 0), Follower(hub, record, 1)
    await _until(lambda: early.heartbeats > 0 and late.heartbeats > 0)  # nothing new: keep-alives
    assert hub.followed_tasks == 1
    leaving = Follower(hub, record, 0)
    await _until(lambda: leaving.ids == [1, 2])
    leaving.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving.task
    await _add(redis, record, 3, 4, final=True)
    assert await early.done() == [1, 2, 3, 4]
    assert await late.done() == [2, 3, 4]
    assert hub.followed_tasks == 0


async def test_a_gap_between_replay_and_the_shared_feed_is_filled(redis: aioredis.Redis, hub: EventHub) -> None:
    """The shared feed read events 4 and 5 on a primary that then died; the promoted replica has 1..3
    (those were all that had reached it) until the worker writes 4 and 5 again, then 6 and 7. A follower
    that joins meanwhile replays 1..3, then gets 6 from the feed, which still reads after 5: it fills
    the gap 4..5 from the log."""
    record = _record()
    await _add(redis, record, 1, 5)
    first = Follower(hub, record, 0)
    await _until(lambda: first.ids == [1, 2, 3, 4, 5] and first.heartbeats > 0)  # the feed is past 5
    await redis.delete(keys.events(record.id))
    await _add(redis, record, 1, 3)
    joining = Follower(hub, record, 0)
    await _until(lambda: joining.ids == [1, 2, 3] and joining.heartbeats > 0)  # it waits on the feed
    assert hub.followed_tasks == 1
    await _add(redis, record, 4, 7, final=True)
    assert await joining.done() == [1, 2, 3, 4, 5, 6, 7]
    assert await first.done() == [1, 2, 3, 4, 5, 6, 7]


async def test_a_cursor_past_the_stored_log_waits_for_it(redis: aioredis.Redis, hub: EventHub) -> None:
    """A client that saw events a failover lost reconnects with a Last-Event-ID past the log: it gets
    what follows that id once the worker has written the lost events again."""
    record = _record()
    await _add(redis, record, 1, 3)
    follower = Follower(hub, record, 5)
    await _until(lambda: follower.heartbeats > 0)
    await _add(redis, record, 4, 8, final=True)
    assert await follower.done() == [6, 7, 8]


async def test_a_follower_of_a_log_that_ends_before_its_cursor_ends_too(redis: aioredis.Redis,
                                                                        hub: EventHub) -> None:
    record = _record()
    await _add(redis, record, 1, 2)
    follower = Follower(hub, record, 6)
    await _until(lambda: follower.heartbeats > 0)
    await _add(redis, record, 3, 4, final=True)
    assert await follower.done() == []


async def _blocked_reads(redis: aioredis.Redis) -> int:
    return sum(client["cmd"] == "xread" and "b" in client["flags"] for client in await redis.client_list())


async def test_one_read_follows_every_task(redis: aioredis.Redis, hub: EventHub) -> None:
    records = [_record() for _ in range(20)]
    followers = [Follower(hub, record, 0) for record in records]
    await _until(lambda: all(follower.heartbeats for follower in followers))
    blocked = []
    for _ in range(20):
        blocked.append(await _blocked_reads(redis))
        await asyncio.sleep(HEARTBEAT / 5)
    assert max(blocked) == 1  # one read for 20 tasks (none between two reads)
    for record in records:
        await _add(redis, record, 1, 3, final=True)
    assert [await follower.done() for follower in followers] == [[1, 2, 3]] * 20
    assert hub.followed_tasks == 0


async def test_a_quiet_task_keeps_its_heartbeat_beside_a_busy_one(redis: aioredis.Redis, hub: EventHub) -> None:
    busy, quiet = _record(), _record()
    talking, waiting = Follower(hub, busy, 0), Follower(hub, quiet, 0)
    for number in range(1, 21):  # an event every half heartbeat: the busy feed never needs one
        await _add(redis, busy, number, number)
        await asyncio.sleep(HEARTBEAT / 2)
    assert waiting.heartbeats >= 5 and len(talking.ids) == 20
    await _add(redis, busy, 21, 21, final=True)
    await _add(redis, quiet, 1, 1, final=True)
    assert await waiting.done() == [1]


async def test_a_task_followed_during_a_blocked_read_is_read_at_once(redis: aioredis.Redis) -> None:
    hub = EventHub(redis, heartbeat=30.0)  # the read blocks for that long unless it is woken
    try:
        first, second = _record(), _record()
        early = Follower(hub, first, 0)
        await _until(lambda: hub.followed_tasks == 1)
        async with asyncio.timeout(10):
            while not await _blocked_reads(redis):
                await asyncio.sleep(0.005)
        joining = Follower(hub, second, 0)
        await _add(redis, second, 1, 2, final=True)
        async with asyncio.timeout(2):  # not the 30 s the read was blocked for
            assert await joining.done() == [1, 2]
        await _add(redis, first, 1, 1, final=True)
        assert await early.done() == [1]
    finally:
        await hub.close()
