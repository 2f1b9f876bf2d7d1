"""arq workers that poll as soon as there is news instead of on a fixed delay.

arq sleeps ``poll_delay`` between polls, which would add up to that delay to every request's time
to first token. Here each model's arq worker waits on an asyncio event instead: set by a
pub/sub message that the API publishes after each enqueue, and when a job of ours finishes (a
slot is free). A slow fallback poll covers lost messages (pub/sub is at most once).

Jobs start in the order of their queue scores (priorities, see ``lmsp_core.queue``): a poll starts
jobs only while this worker has free slots, and the next poll reads the queue afresh, where arq
would wait for a slot and then start the next job of the list it read earlier, ahead of anything
queued meanwhile with a better score.
"""

import asyncio
import contextlib
import logging
from typing import Any

from arq.worker import Worker
from redis.asyncio import Redis
from redis.exceptions import RedisError

from lmsp_core import keys

logger = logging.getLogger(__name__)

FALLBACK_POLL = 1.0


class WakeableWorker(Worker):
    def __init__(self, *args: Any, wake: asyncio.Event, **kwargs: Any) -> None:
        super().__init__(*args, poll_delay=0, handle_signals=False, **kwargs)
        self.wake = wake

    async def _poll_iteration(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), FALLBACK_POLL)
        self.wake.clear()
        await super()._poll_iteration()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        for job_id in job_ids:
            if self.job_counter >= self.max_jobs:
                return  # no free slot: the next poll reads the queue again, in score order
            await super().start_jobs([job_id])

    def _release_sem_dec_counter_on_complete(self) -> None:
        super()._release_sem_dec_counter_on_complete()
        self.wake.set()  # a slot is free: take the best queued job now


async def listen_for_wakes(redis: Redis, wakes: dict[str, asyncio.Event]) -> None:
    """Set the model's wake event for every message on its wake channel; reconnects forever."""
    channels = {keys.wake_channel(model_id).encode(): event for model_id, event in wakes.items()}
    while True:
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(*channels)
            async for message in pubsub.listen():
                if message["type"] == "message":
                    channels[message["channel"]].set()
        except (RedisError, OSError) as exc:
            logger.warning("wake channel lost (%s); resubscribing", type(exc).__name__)
            await asyncio.sleep(0.5)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
