"""What a worker hears on Redis pub/sub: news of its queues, and cancellations of its tasks.

One subscription carries both. Each model's wake channel says a job was queued (``queueworker``:
the model's arq worker polls at once). The worker's own cancel channel names a task of its that a
client cancelled (``scripts.CANCEL`` publishes it), so that the run stops at the engine's next
step rather than at its next append, which may be ``event_flush_interval`` away. Pub/sub is at
most once: after the subscription comes back every queue is polled, and a cancellation sent
meanwhile still reaches its run with the next append's reply (the task's cancel flag).

On Redis Cluster each channel has its own subscription, on the primary of its slot: the wake
channels are sharded (``SSUBSCRIBE``; only the queue's shard carries their messages), the cancel
channel is a plain one, which every node of a cluster carries (a script on the task's shard
publishes it).
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError, RedisError

from lmsp_core.store import cluster

logger = logging.getLogger(__name__)

RESUBSCRIBE_DELAY = 0.5

Handler = Callable[[bytes], None]  # gets a message's data


async def listen(redis: Redis, handlers: Mapping[str, Handler], resubscribed: Callable[[], None], *,
                 sharded: Collection[str] = ()) -> None:
    """Call the channel's handler with every message; reconnects forever, calling ``resubscribed``
    once the subscription is back after a failure (messages sent meanwhile are lost). On a
    cluster the channels in ``sharded`` are shard channels."""
    if not isinstance(redis, cluster.ClusterClient):
        await _listen(redis, handlers, resubscribed, sharded=False)
        return
    async with asyncio.TaskGroup() as group:
        for channel, handler in handlers.items():
            group.create_task(_listen(redis.pinned(channel), {channel: handler}, resubscribed,
                                      sharded=channel in sharded))


async def _listen(redis: Redis, handlers: Mapping[str, Handler], resubscribed: Callable[[], None], *,
                  sharded: bool) -> None:
    channels = {channel.encode(): handler for channel, handler in handlers.items()}
    failing = False
    while True:
        pubsub = redis.pubsub()
        try:
            if sharded:
                await pubsub.execute_command("SSUBSCRIBE", *channels)
            else:
                await pubsub.subscribe(*channels)
            if failing:
                logger.info("subscription back")
                resubscribed()
            failing = False
            await (_deliver_sharded(pubsub, channels) if sharded else _deliver(pubsub, channels))
        except (RedisError, OSError) as exc:
            if not failing:
                logger.warning("subscription lost (%s); subscribing again", type(exc).__name__)
            failing = True
            await asyncio.sleep(RESUBSCRIBE_DELAY)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]


async def _deliver(pubsub: PubSub, channels: Mapping[bytes, Handler]) -> None:
    async for message in pubsub.listen():
        if message["type"] == "message":
            channels[message["channel"]](message["data"])


async def _deliver_sharded(pubsub: PubSub, channels: Mapping[bytes, Handler]) -> None:
    # redis-py 5's PubSub has no sharded subscriptions: their answers are read as they come
    while True:
        kind, channel, data = await pubsub.parse_response(block=True)
        if kind == b"smessage":
            channels[channel](data)
        elif kind == b"sunsubscribe":  # the slot moved to another shard
            raise ConnectionError(f"{channel.decode()} moved to another shard")
