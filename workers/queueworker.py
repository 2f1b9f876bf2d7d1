"""arq workers that poll as soon as there is news instead of on a fixed delay.

arq sleeps ``poll_delay`` between polls, which would add up to that delay to every request's time
to first token. Here each model's arq worker waits on an asyncio event instead: set by a
pub/sub message that the API publishes after each enqueue, and when a job of ours finishes (a
slot is free). A slow fallback poll covers lost messages (pub/sub is at most once).

Which jobs start is the fair queue's choice (``lmsp_core.store.tasks.fairqueue``): with a ``pick``, a
poll asks it for as many jobs as this worker has free slots and starts those; without one (fair
share off) jobs start in the order of their queue scores (priorities, see
``lmsp_core.store.tasks.queue``). Either way a poll starts jobs only while a slot is free, and the next
poll decides afresh, where arq would wait for a slot and then start the next job of the list it
read earlier, ahead of anything queued meanwhile with a better score. A picked job that arq does
not start (another worker runs it, or it left the queue) is left alone: its running entry lapses.

arq's poll loop ends on the first Redis error, and a Redis error while it starts a job leaks that
job's slot; both would leave a worker that looks alive but never takes a job again after Redis
restarts. ``WakeableWorker`` keeps polling through errors and gives leaked slots back.

This is the one module that knows arq's internals: the methods it overrides and the attributes it
uses (``ARQ_INTERNALS``) are not arq's public API. ``tests/unit/test_queueworker.py`` fails, naming
the change, when an arq release renames or reshapes one of them; docs/queue.md says which parts of
arq the service uses and which it switches off.
"""

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix
from arq.worker import Worker
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

FALLBACK_POLL = 1.0

# arq.worker.Worker's non-public parts this module relies on (arq 0.28): methods overridden or
# called, with their parameters, and attributes read or changed
ARQ_INTERNALS: dict[str, tuple[str, ...]] = {
    "_poll_iteration": ("self",),  # one poll: read the queue, start jobs, reap finished tasks
    "start_jobs": ("self", "job_ids"),  # takes a slot (sem, job_counter) per job before its Redis calls
    "_release_sem_dec_counter_on_complete": ("self",),  # called when a started job's task ends
    "handle_sig": ("self", "signum"),  # cancels the running jobs (shutdown)
    # replaced (see ``finish_job``): a job's end, in one transaction
    "finish_job": ("self", "job_id", "finish", "result_data", "result_timeout_s", "keep_result_forever", "incr_score",
                   "keep_in_progress"),
    "finish_failed_job": ("self", "job_id", "result_data"),
}
ARQ_ATTRIBUTES = ("sem", "job_counter", "max_jobs", "tasks", "allow_pick_jobs", "queue_name", "pool",
                  "allow_abort_jobs", "keep_result_s", "keep_result_forever")


Pick = Callable[[int], Awaitable[list[str]]]  # free slots -> the job ids to start, in order


class WakeableWorker(Worker):
    def __init__(self, *args: Any, wake: asyncio.Event, pick: Pick | None = None, **kwargs: Any) -> None:
        if pick is not None:
            kwargs["queue_read_limit"] = 1  # arq's read only tells whether anything is queued
        super().__init__(*args, poll_delay=0, handle_signals=False, **kwargs)
        if self.allow_abort_jobs or self.keep_result_s or self.keep_result_forever:
            raise ValueError("WakeableWorker ends jobs without aborts or kept results (see finish_job)")
        self.wake = wake
        self.pick = pick
        self._failing = False

    async def _poll_iteration(self) -> None:
        # not asyncio.wait_for: on 3.11 it swallows a cancellation that arrives as the event is set,
        # and the poll loop would outlive the worker's shutdown
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FALLBACK_POLL):
                await self.wake.wait()
        self.wake.clear()
        try:
            await super()._poll_iteration()
        except (RedisError, OSError) as exc:
            if not self._failing:
                logger.warning("polling %s failed (%s); retrying", self.queue_name, type(exc).__name__)
            self._failing = True
        else:
            if self._failing:
                logger.info("polling %s again", self.queue_name)
            self._failing = False

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        if self.pick is not None:
            if not job_ids or self.job_counter >= self.max_jobs:
                return  # arq's read found nothing queued, or no slot is free
            job_ids = [job.encode() for job in await self.pick(self.max_jobs - self.job_counter)]
        for job_id in job_ids:
            if self.job_counter >= self.max_jobs:
                return  # no free slot: the next poll reads the queue again, in score order
            before = self.tasks.get(job_id.decode())
            try:
                await super().start_jobs([job_id])
            except (RedisError, OSError):
                # arq took a slot for the job before the Redis call that failed and did not start it
                if self.tasks.get(job_id.decode()) is before:
                    self.job_counter -= 1
                    self.sem.release()
                raise

    def _release_sem_dec_counter_on_complete(self) -> None:
        super()._release_sem_dec_counter_on_complete()
        self.wake.set()  # a slot is free: take the best queued job now

    # --- a job's end -------------------------------------------------------------------------------
    # arq's own versions also remove the job from its abort set, one key (``arq:abort``) for every
    # queue: on a Redis Cluster it is in another slot than the queue and the job's keys, and the
    # whole transaction would be refused (CROSSSLOT). Jobs are never aborted here
    # (``allow_abort_jobs`` stays off) and results are not kept (``keep_result=0``), so a job's end
    # is: forget the job and its markers, take it off the queue (or, not finished, move it on).

    async def finish_job(self, job_id: str, finish: bool, result_data: bytes | None, result_timeout_s: float | None,
                         keep_result_forever: bool, incr_score: int | None, keep_in_progress: float | None) -> None:
        async with self.pool.pipeline(transaction=True) as tr:
            markers = [in_progress_key_prefix + job_id] if keep_in_progress is None else []
            if keep_in_progress is not None:
                tr.pexpire(in_progress_key_prefix + job_id, int(keep_in_progress * 1000))
            if finish:
                tr.delete(*markers, retry_key_prefix + job_id, job_key_prefix + job_id)
                tr.zrem(self.queue_name, job_id)
            else:
                if markers:
                    tr.delete(*markers)
                if incr_score:
                    tr.zincrby(self.queue_name, incr_score, job_id)
            await tr.execute()

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        async with self.pool.pipeline(transaction=True) as tr:
            tr.delete(retry_key_prefix + job_id, in_progress_key_prefix + job_id, job_key_prefix + job_id)
            tr.zrem(self.queue_name, job_id)
            await tr.execute()

    # --- shutting down (workers/main.py) ---------------------------------------------------------

    def stop_taking_jobs(self) -> None:
        self.allow_pick_jobs = False

    def running_jobs(self) -> list[asyncio.Task[Any]]:
        return list(self.tasks.values())

    def cancel_jobs(self) -> None:
        """Cancel the running jobs (each hands its task back); arq keeps their jobs queued."""
        self.handle_sig(signal.SIGTERM)
