"""What a worker hears on Redis pub/sub: news of its queues, and cancellations of its tasks.

One subscription carries both. Each model's wake channel says a job was queued (``queueworker``:
the model's arq worker polls at once). The worker's own cancel channel names a task of its that a
client cancelled (``scripts.CANCEL`` publishes it), so that the run stops at the engine's next
step rather than at its next append, which may be ``event_flush_interval`` away. Pub/sub is at
most once: after the subscription comes back every queue is polled, and a cancellation sent
meanwhile still reaches its run with the next append's reply (the task's cancel flag).
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

RESUBSCRIBE_DELAY = 0.5

Handler = Callable[[bytes], None]  # gets a message's data


async def listen(redis: Redis, handlers: Mapping[str, Handler], resubscribed: Callable[[], None]) -> None:
    """Call the channel's handler with every message; reconnects forever, calling ``resubscribed``
    once the subscription is back after a failure (messages sent meanwhile are lost)."""
    channels = {channel.encode(): handler for channel, handler in handlers.items()}
    failing = False
    while True:
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(*channels)
            if failing:
                logger.info("subscription back")
                resubscribed()
            failing = False
            async for message in pubsub.listen():
                if message["type"] == "message":
                    channels[message["channel"]](message["data"])
        except (RedisError, OSError) as exc:
            if not failing:
                logger.warning("subscription lost (%s); subscribing again", type(exc).__name__)
            failing = True
            await asyncio.sleep(RESUBSCRIBE_DELAY)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
