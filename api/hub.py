"""Following task event logs: replay from Redis, then live delivery shared per task.

Each API process runs at most one blocking ``XREAD`` per followed task, however many clients
follow it. A read's events become one link of a chain that every follower walks at its own pace
(a broadcast list: delivering costs one future, not one queue operation per follower, and a
follower that fell behind takes every link already there at once). When a read times out after
the heartbeat interval, the feed adds an empty link: the followers' keep-alive, with no timer of
their own.

A follower replays what it missed with ``XRANGE`` first; because event numbers are consecutive,
it notices any gap between its replay and the shared feed and fills it with another ``XRANGE``.
So every follower gets each event exactly once and in order, whenever it joins.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from lmsp_core.store import eventlog, keys
from lmsp_core.store.eventlog import Event
from lmsp_core.store.tasks import TaskRecord

logger = logging.getLogger(__name__)

Events = list[Event]  # consecutive events, oldest first


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
        self.runner: asyncio.Task[None] | None = None

    def deliver(self, events: Events) -> None:
        link = _Link(events)
        self.tail.next.set_result(link)
        self.tail = link

    def fail(self, exc: BaseException) -> None:
        self.tail.next.set_exception(exc)
        self.tail.next.exception()  # retrieved: no "never retrieved" warning when nobody waits


class EventHub:
    def __init__(self, redis: Redis, heartbeat: float) -> None:
        self.redis = redis
        self.block_ms = max(1, int(heartbeat * 1000))
        self._feeds: dict[str, _Feed] = {}

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
        feed = self._feeds.get(record.id)
        if feed is None:
            feed = self._feeds[record.id] = _Feed(record.id, record.response_id, cursor)
            feed.runner = asyncio.create_task(self._run(feed), name=f"feed-{record.id}")
        feed.followers += 1
        return feed

    def _detach(self, feed: _Feed) -> None:
        feed.followers -= 1
        if not feed.followers:
            self._end(feed)

    def _end(self, feed: _Feed) -> None:
        if self._feeds.get(feed.task_id) is feed:
            del self._feeds[feed.task_id]
        if feed.runner is not None and feed.runner is not asyncio.current_task():
            feed.runner.cancel()

    async def _run(self, feed: _Feed) -> None:
        key = keys.events(feed.task_id)
        try:
            while feed.followers:
                reply = await self.redis.xread({key: eventlog.stream_id(feed.cursor)}, block=self.block_ms,
                                               count=eventlog.READ_CHUNK)
                if not reply:
                    feed.deliver([])  # nothing for a heartbeat interval
                for _, entries in reply:
                    events = eventlog.to_events(entries, feed.response_id)
                    feed.deliver(events)
                    feed.cursor = events[-1].id
                    if events[-1].final:
                        return
        except (RedisError, OSError) as exc:
            feed.fail(exc)
        finally:
            self._end(feed)

    async def close(self) -> None:
        runners = [feed.runner for feed in self._feeds.values() if feed.runner is not None]
        for runner in runners:
            runner.cancel()
        for runner in runners:
            with contextlib.suppress(asyncio.CancelledError):
                await runner
