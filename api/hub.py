"""Following task event logs: replay from Redis, then live delivery shared per task.

Each API process runs at most one blocking ``XREAD`` per followed task, however many clients
follow it, and fans each read's events out to the followers' queues as one batch. A follower
replays what it missed with ``XRANGE`` first; because event numbers are consecutive, it notices
any gap between its replay and the shared feed and fills it with another ``XRANGE``. So every
follower gets each event exactly once and in order, whenever it joins.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from lmsp_core import eventlog, keys
from lmsp_core.eventlog import Event
from lmsp_core.tasks import TaskRecord

logger = logging.getLogger(__name__)

BLOCK_MS = 5000

Batch = list[Event]  # consecutive events, oldest first
Delivery = Batch | BaseException


class _Feed:
    def __init__(self, task_id: str, response_id: str, cursor: int) -> None:
        self.task_id = task_id
        self.response_id = response_id
        self.cursor = cursor
        self.queues: set[asyncio.Queue[Delivery]] = set()
        self.runner: asyncio.Task[None] | None = None

    def deliver(self, item: Delivery) -> None:
        for queue in self.queues:
            queue.put_nowait(item)


class EventHub:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._feeds: dict[str, _Feed] = {}

    @property
    def followed_tasks(self) -> int:
        return len(self._feeds)

    async def follow(self, record: TaskRecord, after: int, heartbeat: float) -> AsyncIterator[Batch | None]:
        """Batches of the events numbered above ``after``, up to and including the final one; ``None``
        after each ``heartbeat`` seconds without an event. A batch holds whatever arrived together
        (a replayed chunk, or what a slow reader has not taken yet), so a busy API writes less
        often instead of falling behind. Raises RedisError if Redis goes away."""
        last = after
        async for batch in self._replay(record, last):
            yield batch
            last = batch[-1].id
            if batch[-1].final:
                return
        tail = await eventlog.last_event(self.redis, record.id, record.response_id)
        if tail is not None and tail.final and tail.id <= last:
            return  # the task ended at or before the cursor
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        # the feed reads from what is stored now, even when the cursor is beyond it
        feed = self._attach(record, queue, min(last, tail.id if tail else 0))
        try:
            async for item in self._live(record, queue, last, heartbeat):
                yield item
        finally:
            self._detach(feed, queue)

    async def _live(self, record: TaskRecord, queue: "asyncio.Queue[Delivery]", last: int,
                    heartbeat: float) -> AsyncIterator[Batch | None]:
        # first whatever the shared feed delivered before we attached
        async for batch in self._replay(record, last):
            yield batch
            last = batch[-1].id
            if batch[-1].final:
                return
        while True:
            delivered = await self._next(queue, heartbeat)
            if delivered is None:
                yield None
                continue
            fresh: Batch = []
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
    async def _next(queue: "asyncio.Queue[Delivery]", heartbeat: float) -> Batch | None:
        """Everything delivered so far (waiting up to ``heartbeat`` for the first), or None."""
        try:
            async with asyncio.timeout(heartbeat):
                items = [await queue.get()]
        except TimeoutError:
            return None
        while not queue.empty():
            items.append(queue.get_nowait())
        events: Batch = []
        for item in items:
            if isinstance(item, BaseException):
                if not events:
                    raise item
                queue.put_nowait(item)  # the feed has ended: raise once these are out
                break
            events += item
        return events

    async def _replay(self, record: TaskRecord, after: int, until: int | None = None) -> AsyncIterator[Batch]:
        while True:
            chunk = await eventlog.read_after(self.redis, record.id, record.response_id, after, until=until)
            if chunk:
                yield chunk
            if len(chunk) < eventlog.READ_CHUNK:
                return
            after = chunk[-1].id

    def _attach(self, record: TaskRecord, queue: asyncio.Queue[Delivery], cursor: int) -> _Feed:
        feed = self._feeds.get(record.id)
        if feed is None:
            feed = self._feeds[record.id] = _Feed(record.id, record.response_id, cursor)
            feed.runner = asyncio.create_task(self._run(feed), name=f"feed-{record.id}")
        feed.queues.add(queue)
        return feed

    def _detach(self, feed: _Feed, queue: asyncio.Queue[Delivery]) -> None:
        feed.queues.discard(queue)
        if not feed.queues:
            self._end(feed)

    def _end(self, feed: _Feed) -> None:
        if self._feeds.get(feed.task_id) is feed:
            del self._feeds[feed.task_id]
        if feed.runner is not None and feed.runner is not asyncio.current_task():
            feed.runner.cancel()

    async def _run(self, feed: _Feed) -> None:
        key = keys.events(feed.task_id)
        try:
            while feed.queues:
                reply = await self.redis.xread({key: eventlog.stream_id(feed.cursor)}, block=BLOCK_MS, count=512)
                for _, entries in reply:
                    events = eventlog.to_events(entries, feed.response_id)
                    feed.deliver(events)
                    feed.cursor = events[-1].id
                    if events[-1].final:
                        return
        except (RedisError, OSError) as exc:
            feed.deliver(exc)
        finally:
            self._end(feed)

    async def close(self) -> None:
        runners = [feed.runner for feed in self._feeds.values() if feed.runner is not None]
        for runner in runners:
            runner.cancel()
        for runner in runners:
            with contextlib.suppress(asyncio.CancelledError):
                await runner
