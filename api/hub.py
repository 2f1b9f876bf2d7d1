"""Following task event logs: replay from Redis, then live delivery shared per task.

Each API process runs at most one blocking ``XREAD`` per followed task, however many clients
follow it, and fans new events out to the followers' queues. A follower replays what it missed
with ``XRANGE`` first; because event numbers are consecutive, it notices any gap between its
replay and the shared feed and fills it with another ``XRANGE``. So every follower gets each
event exactly once and in order, whenever it joins.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from lmsp_core import eventlog, keys
from lmsp_core.eventlog import Event

logger = logging.getLogger(__name__)

BLOCK_MS = 5000

Delivery = Event | BaseException


class _Feed:
    def __init__(self, task_id: str, cursor: int) -> None:
        self.task_id = task_id
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

    async def follow(self, task_id: str, after: int, heartbeat: float) -> AsyncIterator[Event | None]:
        """Events numbered above ``after`` up to and including the final one; ``None`` after each
        ``heartbeat`` seconds without an event. Raises RedisError if Redis goes away."""
        last = after
        async for event in self._replay(task_id, last):
            yield event
            last = event.id
            if event.final:
                return
        tail = await eventlog.last_event(self.redis, task_id)
        if tail is not None and tail.final and tail.id <= last:
            return  # the task ended at or before the cursor
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        # the feed reads from what is stored now, even when the cursor is beyond it
        feed = self._attach(task_id, queue, min(last, tail.id if tail else 0))
        try:
            async for item in self._live(task_id, queue, last, heartbeat):
                yield item
        finally:
            self._detach(feed, queue)

    async def _live(self, task_id: str, queue: "asyncio.Queue[Delivery]", last: int,
                    heartbeat: float) -> AsyncIterator[Event | None]:
        # first whatever the shared feed delivered before we attached
        async for event in self._replay(task_id, last):
            yield event
            last = event.id
            if event.final:
                return
        while True:
            item = await self._next(queue, heartbeat)
            if item is None:
                yield None
                continue
            if item.id <= last:
                if item.final:
                    return  # the task ended before reaching the cursor
                continue
            # event numbers are consecutive: a jump means the feed passed events before we joined
            gap = [e async for e in self._replay(task_id, last, until=item.id - 1)] if item.id > last + 1 else []
            for event in [*gap, item]:
                yield event
                last = event.id
            if item.final:
                return

    @staticmethod
    async def _next(queue: "asyncio.Queue[Delivery]", heartbeat: float) -> Event | None:
        try:
            item = await asyncio.wait_for(queue.get(), heartbeat)
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def _replay(self, task_id: str, after: int, until: int | None = None) -> AsyncIterator[Event]:
        while True:
            chunk = await eventlog.read_after(self.redis, task_id, after, until=until)
            for event in chunk:
                yield event
            if len(chunk) < eventlog.READ_CHUNK:
                return
            after = chunk[-1].id

    def _attach(self, task_id: str, queue: asyncio.Queue[Delivery], cursor: int) -> _Feed:
        feed = self._feeds.get(task_id)
        if feed is None:
            feed = self._feeds[task_id] = _Feed(task_id, cursor)
            feed.runner = asyncio.create_task(self._run(feed), name=f"feed-{task_id}")
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
                    events = eventlog.to_events(entries)
                    for event in events:
                        feed.deliver(event)
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
