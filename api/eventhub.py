"""Following task event logs: replay from Redis, then live delivery shared per task.

Each API process reads the live events of every task it follows with one blocking ``XREAD`` over
all their streams, however many tasks and clients there are: a read returns whatever arrived for
any of them, so that a busy service costs a read per batch of tasks, not one per task and event
(docs/performance.md, "The path of an event"). The read also names a stream of the hub's own
(``keys.hub_wake``): an entry added there ends a blocked read at once, so that the next read
includes a task that began to be followed meanwhile. A read's events for a task become one link of
a chain that every follower of that task walks at its own pace (a broadcast list: delivering costs
one future, not one queue operation per follower, and a follower that fell behind takes every link
already there at once). A task that received nothing for a heartbeat interval gets an empty link:
its followers' keep-alive, with no timer of their own.

A follower replays what it missed with ``XRANGE`` first; because event numbers are consecutive,
it notices any gap between its replay and the shared feed and fills it with another ``XRANGE``.
So every follower gets each event exactly once and in order, whenever it joins.

On Redis Cluster one read cannot name streams of several slots, and each task has its own: there
each followed task has a blocking ``XREAD`` of its own, a connection to its shard while followed
(docs/reliability.md, "Redis Cluster"); everything else is the same.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import KeyT, StreamIdT

from lmsp_core.store import connections, keys
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.eventlog import Event
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire import ids

logger = logging.getLogger(__name__)

Events = list[Event]  # consecutive events, oldest first
WAKE_TTL = 3600.0  # seconds a hub's wake stream outlives its last entry (an API process that died leaves it)


class _Link:
    """One read of a feed (no events: a heartbeat) and the future of the next one."""

    __slots__ = ("events", "next")

    def __init__(self, events: Events) -> None:
        self.events = events
        self.next: asyncio.Future[_Link] = asyncio.get_running_loop().create_future()


class _Feed:
    def __init__(self, task_id: str, response_id: str, cursor: int) -> None:
        self.task_id = task_id
        self.response_id = response_id
        self.cursor = cursor
        self.tail = _Link([])
        self.followers = 0
        self.delivered_at = time.monotonic()  # the last link, a heartbeat too
        self.reader: asyncio.Task[None] | None = None  # its own reader, on a cluster

    def deliver(self, events: Events) -> None:
        link = _Link(events)
        self.tail.next.set_result(link)
        self.tail = link
        self.delivered_at = time.monotonic()
        if events:
            self.cursor = events[-1].id

    def fail(self, exc: BaseException) -> None:
        self.tail.next.set_exception(exc)
        self.tail.next.exception()  # retrieved: no "never retrieved" warning when nobody waits


class EventHub:
    def __init__(self, redis: Redis, heartbeat: float) -> None:
        self.redis = redis
        self.heartbeat = heartbeat
        self._feeds: dict[str, _Feed] = {}  # by events key
        self._reader: asyncio.Task[None] | None = None
        self._wake_key = keys.hub_wake(ids.new_id("hub"))
        self._woken = "0-0"  # the last wake entry the reader saw
        self._waking: asyncio.Task[None] | None = None
        self._per_task = connections.is_cluster(redis)

    @property
    def followed_tasks(self) -> int:
        return len(self._feeds)

    async def follow(self, record: TaskRecord, after: int) -> AsyncIterator[Events | None]:
        """Batches of the events numbered above ``after``, up to and including the final one; ``None``
        for each heartbeat interval without an event. A batch holds whatever arrived together (a
        replayed chunk, or what a slow reader has not taken yet), so a busy API writes less often
        instead of falling behind. Raises RedisError if Redis goes away."""
        last = after
        async for batch in self._replay(record, last):
            yield batch
            last = batch[-1].id
            if batch[-1].final:
                return
        tail = await eventlog.last_event(self.redis, record.id, record.response_id)
        if tail is not None and tail.final and tail.id <= last:
            return  # the task ended at or before the cursor
        # the feed reads from what is stored now, even when the cursor is beyond it
        feed = self._attach(record, min(last, tail.id if tail else 0))
        try:
            async for item in self._live(record, feed.tail, last):
                yield item
        finally:
            self._detach(feed)

    async def _live(self, record: TaskRecord, link: _Link, last: int) -> AsyncIterator[Events | None]:
        # first whatever the shared feed delivered before we attached
        async for batch in self._replay(record, last):
            yield batch
            last = batch[-1].id
            if batch[-1].final:
                return
        while True:
            link, delivered = await self._next(link)
            if not delivered:
                yield None
                continue
            fresh: Events = []
            for event in delivered:
                if event.id <= last:
                    if event.final:
                        return  # the task ended before reaching the cursor
                    continue
                # event numbers are consecutive: a jump means the feed passed events before we joined
                if event.id > last + 1:
                    async for gap in self._replay(record, last, until=event.id - 1):
                        fresh += gap
                fresh.append(event)
                last = event.id
            if fresh:
                yield fresh
                if fresh[-1].final:
                    return

    @staticmethod
    async def _next(link: _Link) -> tuple[_Link, Events]:
        """The links after ``link`` that are there (waiting for the first): the last one and their events."""
        # shielded: cancelling a task cancels the future it awaits, and this one is every follower's
        # (one client going away would end the others' streams and the feed with them)
        link = await asyncio.shield(link.next)
        events = list(link.events)
        while link.next.done() and link.next.exception() is None:
            link = link.next.result()
            events += link.events
        return link, events

    async def _replay(self, record: TaskRecord, after: int, until: int | None = None) -> AsyncIterator[Events]:
        while True:
            chunk = await eventlog.read_after(self.redis, record.id, record.response_id, after, until=until)
            if chunk:
                yield chunk
            if len(chunk) < eventlog.READ_CHUNK:
                return
            after = chunk[-1].id

    def _attach(self, record: TaskRecord, cursor: int) -> _Feed:
        key = keys.events(record.id)
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = _Feed(record.id, record.response_id, cursor)
            if self._per_task:
                feed.reader = asyncio.create_task(self._read_one(key, feed), name="event-feed")
            else:
                self._read_it()
        feed.followers += 1
        return feed

    def _detach(self, feed: _Feed) -> None:
        feed.followers -= 1
        if not feed.followers:
            self._end(feed)

    def _end(self, feed: _Feed) -> None:
        key = keys.events(feed.task_id)
        if self._feeds.get(key) is feed:
            del self._feeds[key]  # the reader's next read leaves it out
        if feed.reader is not None and feed.reader is not asyncio.current_task():
            feed.reader.cancel()  # followed no more: its blocking read would hold a connection

    def _read_it(self) -> None:
        """Have the reader include a new feed: start it, or end the read it is blocked in."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name="event-hub")
        elif self._waking is None or self._waking.done():
            self._waking = asyncio.create_task(self._wake())

    async def _wake(self) -> None:
        with contextlib.suppress(RedisError, OSError):  # the reader's own read fails too, and says so
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.pexpire(self._wake_key, int(WAKE_TTL * 1000))
                await pipe.execute()

    async def _read(self) -> None:
        """Read every followed task's new events, until no task is followed."""
        try:
            while self._feeds:
                feeds = dict(self._feeds)
                streams: dict[KeyT, StreamIdT] = {key: eventlog.stream_id(feed.cursor) for key, feed in feeds.items()}
                streams[self._wake_key] = self._woken
                reply = await self.redis.xread(streams, block=self._block_ms(), count=eventlog.READ_CHUNK)
                for key, entries in reply or []:
                    self._take(key.decode() if isinstance(key, bytes) else key, entries, feeds)
                self._keep_alive()
        except (RedisError, OSError) as exc:
            for feed in list(self._feeds.values()):
                feed.fail(exc)
                self._end(feed)

    async def _read_one(self, key: str, feed: _Feed) -> None:
        """A feed's own reader (on a cluster): its new events, or a heartbeat when none came."""
        try:
            while self._feeds.get(key) is feed:
                block_ms = max(1, int((feed.delivered_at + self.heartbeat - time.monotonic()) * 1000))
                reply = await self.redis.xread({key: eventlog.stream_id(feed.cursor)}, block=block_ms,
                                               count=eventlog.READ_CHUNK)
                if reply:
                    self._take(key, reply[0][1], {key: feed})
                elif time.monotonic() - feed.delivered_at >= self.heartbeat:
                    feed.deliver([])
        except (RedisError, OSError) as exc:
            feed.fail(exc)
            self._end(feed)

    def _take(self, key: str, entries: list[tuple[bytes, dict[bytes, bytes]]], feeds: dict[str, _Feed]) -> None:
        if key == self._wake_key:
            self._woken = entries[-1][0].decode()
            return
        feed = feeds[key]
        events = eventlog.to_events(entries, feed.response_id)
        feed.deliver(events)
        if events[-1].final:
            self._end(feed)

    def _block_ms(self) -> int:
        """Until the next feed's heartbeat is due."""
        due = min(feed.delivered_at for feed in self._feeds.values()) + self.heartbeat
        return max(1, int((due - time.monotonic()) * 1000))

    def _keep_alive(self) -> None:
        now = time.monotonic()
        for feed in list(self._feeds.values()):
            if now - feed.delivered_at >= self.heartbeat:
                feed.deliver([])  # nothing for a heartbeat interval

    async def close(self) -> None:
        readers = [feed.reader for feed in self._feeds.values() if feed.reader is not None]
        for task in (self._reader, self._waking, *readers):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
