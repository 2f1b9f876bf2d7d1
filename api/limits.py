"""Per-principal limits shared by all API processes through Redis: request rate and open streams.

Both are off by default with ``LMSP_AUTH=none`` (one principal: every local client), on with
tokens; an explicit ``LMSP_RATE_LIMIT`` / ``LMSP_MAX_STREAMS`` applies in either mode.

Rate: a fixed window per principal. The first request of a window creates a counter that expires
after ``LMSP_RATE_WINDOW`` seconds (Redis's clock, not the hosts'); a request above
``LMSP_RATE_LIMIT`` in the window gets ``429 rate_limited`` with ``Retry-After`` = the window's rest.

Streams: each open SSE stream is a member of the principal's sorted set, scored with the time its
lease ends. The API process that holds the stream renews the lease every few seconds and removes
the member when the stream ends; a member of a crashed process lapses after ``LMSP_STREAM_LEASE``
seconds, so a crash cannot leak slots for longer than that.
"""

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator
from typing import TypeVar

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from lmsp_core.settings import Settings
from lmsp_core.store import cluster, keys
from lmsp_core.wire import ids
from lmsp_core.wire.errors import TooManyRequests

logger = logging.getLogger(__name__)

_NOW_MS = "local t = redis.call('TIME') local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# KEYS: the counter; ARGV: window_ms. Returns {count, ms left in the window}.
_COUNT = """
local n = redis.call('INCR', KEYS[1])
local ttl = redis.call('PTTL', KEYS[1])
if n == 1 or ttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  ttl = tonumber(ARGV[1])
end
return {n, ttl}
"""

# KEYS: the principal's stream set; ARGV: member, lease_ms, limit. Returns 1 if the slot was taken.
_ACQUIRE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if tonumber(ARGV[3]) > 0 and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: the principal's stream set; ARGV: lease_ms, members... (only members still present)
_RENEW = _NOW_MS + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now_ms + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

T = TypeVar("T")


class Limits:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self._count = redis.register_script(_COUNT)
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._open: dict[str, set[str]] = {}  # principal -> members held by this process
        self._renewer: asyncio.Task[None] | None = None

    async def count_request(self, principal: str) -> None:
        limit = self.settings.principal_rate_limit
        if limit == 0:
            return
        count, left_ms = await self._count(keys=[keys.rate(principal)],
                                           args=[int(self.settings.rate_window * 1000)])
        if int(count) > limit:
            raise TooManyRequests(f"More than {limit} requests in {self.settings.rate_window:g} s; retry later.",
                                  retry_after=-(-int(left_ms) // 1000))

    async def open_stream(self, principal: str) -> "StreamSlot":
        """Take one of the principal's stream slots, or raise 429 ``too_many_streams``."""
        member = ids.new_id("sse")
        limit = self.settings.principal_max_streams
        taken = await self._acquire(keys=[keys.streams(principal)], args=[member, self._lease_ms, limit])
        if not taken:
            raise TooManyRequests(f"This principal already has {limit} open streams; close one or retry later.",
                                  retry_after=5, code="too_many_streams")
        self._open.setdefault(principal, set()).add(member)
        return StreamSlot(self, principal, member)

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.stream_lease * 1000)

    def forget(self, principal: str, member: str) -> None:
        held = self._open.get(principal)
        if held is not None:
            held.discard(member)
            if not held:
                del self._open[principal]

    async def release(self, principal: str, member: str) -> None:
        self.forget(principal, member)
        with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
            await self.redis.zrem(keys.streams(principal), member)

    def start(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop(), name="stream-slot-renewal")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stream_lease / 3)
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for principal, members in list(self._open.items()):
                        cluster.evalsha(pipe, self._renew, [keys.streams(principal)], [self._lease_ms, *members])
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                logger.warning("stream slot renewal failed: %s", type(exc).__name__)


class StreamSlot:
    """One open stream of a principal; ``wrap`` ties the slot's release to the end of the events."""

    def __init__(self, limits: Limits, principal: str, member: str) -> None:
        self._limits = limits
        self.principal = principal
        self.member = member

    def wrap(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        wrapped = self._until_end(events)
        # a stream that never starts (client gone before the first byte) never runs its finally:
        # stop renewing the slot when the generator is collected, so that it lapses
        weakref.finalize(wrapped, self._limits.forget, self.principal, self.member)
        return wrapped

    async def _until_end(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        try:
            async for item in events:
                yield item
        finally:
            await self.release()

    async def release(self) -> None:
        await self._limits.release(self.principal, self.member)
