"""The worker process's service: its models, its running tasks, and the job that arq calls.

A job only carries a task id. The job claims the task (atomically, under a fresh lease),
resumes it from whatever an earlier holder stored, runs it on the model's engine and returns once
the task's final event is stored. Every step is safe to repeat: a second delivery of the same job
finds the task claimed or final and does nothing.
"""

import asyncio
import logging
import secrets
import time
from collections import Counter
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from lmsp_core import tracing, wire
from lmsp_core.settings import Settings
from lmsp_core.store import keys, metrics, registry
from lmsp_core.store.tasks import finished, queue
from lmsp_core.store.tasks.records import ClaimOutcome, TaskRecord, TaskStore
from lmsp_core.store.tenants.principals import SettingsCache
from lmsp_core.wire.errors import GenerationFailed
from workers import notices
from workers.taskrun import ModelRuntime, TaskRun, load_history
from workers.writer import EventWriter

logger = logging.getLogger(__name__)

HAND_BACK_LIMIT = 5.0  # seconds a stopping worker tries to store a task's last events


class JobEnd(msgspec.Struct, frozen=True):
    """How a job's run ended, for the fair queue (``WorkerService.job_ended``); a job that ran
    nothing (its task was final, held or gone) is charged nothing."""

    principal: str = ""
    used_tokens: int = 0
    handed_back: bool = False


class WorkerService:
    def __init__(self, settings: Settings, redis: Redis, runtimes: dict[str, ModelRuntime],
                 info: registry.WorkerInfo) -> None:
        self.settings = settings
        self.redis = redis
        self.runtimes = runtimes
        self.store = TaskStore(redis, settings)
        self.writer = EventWriter(redis, settings)
        self.metrics = metrics.Recorder()
        self.runs: dict[str, TaskRun] = {}
        self.jobs: dict[str, str] = {}  # task id -> the job that runs it here
        self.principals = SettingsCache(redis)
        self._ended: dict[str, JobEnd] = {}  # job id -> its end, until arq has finished the job
        self.info = msgspec.structs.replace(info, state="ready")
        self.wakes = {model_id: asyncio.Event() for model_id in runtimes}
        self._changed = asyncio.Condition()

    def notices(self) -> dict[str, notices.Handler]:
        """What this worker listens to (``workers.notices``): its queues' wakes and its cancellations."""
        handlers = {keys.wake_channel(model_id): _setter(wake) for model_id, wake in self.wakes.items()}
        handlers[keys.cancel_channel(self.info.id)] = self.cancel_requested
        return handlers

    def wake_channels(self) -> set[str]:
        """The channels of ``notices`` that are per model: sharded on a cluster."""
        return {keys.wake_channel(model_id) for model_id in self.wakes}

    def poll_all(self) -> None:
        for wake in self.wakes.values():
            wake.set()

    def cancel_requested(self, task_id: bytes) -> None:
        run = self.runs.get(task_id.decode())
        if run is not None:
            run.on_cancel_requested()

    async def generate(self, ctx: dict[str, Any], task_id: str) -> str:
        """The arq job: run one task to its final event (or hand it back when cancelled)."""
        return await self._run_task(task_id, str(ctx["job_id"]))

    async def pick(self, model_id: str, slots: int) -> list[str]:
        """The jobs a free slot of ``model_id`` starts next (``WakeableWorker``'s pick)."""
        table = await self.principals.table()
        return await self.store.fair.pick(model_id, slots, self.store.lease_ttl_ms, table)

    async def job_ended(self, model_id: str, ctx: dict[str, Any]) -> None:
        """arq's hook after it has finished a job of ``model_id``: settle the job in the fair queue.
        Only now, so a handed-back job waits again once arq no longer marks it running (before, a
        worker that picked it could not start it)."""
        end = self._ended.pop(str(ctx["job_id"]), JobEnd())
        if not self.settings.fair_share:
            return
        try:
            await self.store.fair.finish(model_id, str(ctx["job_id"]), end.used_tokens,
                                         self.principals.weight(end.principal), requeue=end.handed_back)
        except RedisError as exc:  # its running entry lapses; the reaper gives a handed-back job back
            logger.warning("fair queue: could not settle job %s (%s)", ctx["job_id"], type(exc).__name__)

    async def _run_task(self, task_id: str, job_id: str) -> str:
        record = await self.store.get(task_id)
        if record is None:
            return "missing"
        runtime = self.runtimes.get(record.model)
        if runtime is None:
            logger.error("task %s is for model %s, which this worker does not run", task_id, record.model)
            return "wrong-model"
        lease = f"{self.info.id}/{secrets.token_hex(8)}"
        failure = GenerationFailed(
            f"The task was given up after {self.settings.max_attempts} attempts: its worker stopped each time.",
            code="worker_lost").problem()
        claim = await self.store.claim(record, self.info.id, job_id, lease, failure, await self._last_output(record))
        if claim.outcome is ClaimOutcome.EXHAUSTED:
            self.metrics.count(metrics.FINISHED, (record.model, "failed"))
            await self._announce(task_id)
        if claim.outcome is not ClaimOutcome.CLAIMED:
            return claim.outcome.value
        claimed_at = time.time()
        if claim.attempts == 1:
            self.metrics.observe(metrics.QUEUE_TIME, (record.model,), max(0.0, claimed_at - record.created_at))
        else:
            self.metrics.count(metrics.RECLAIMS, (record.model,))
        trace = tracing.RunTrace(record.trace, model=record.model, task_id=task_id, response_id=record.response_id,
                                 attempt=claim.attempts, worker=self.info.id, created_at=record.created_at,
                                 claimed_at=claimed_at) if tracing.enabled() else None
        run = TaskRun(record, runtime, self.writer, self.settings, lease, self.metrics, trace)
        self.runs[task_id] = run
        self.jobs[task_id] = job_id
        handed_back = False
        try:
            history = await load_history(self.redis, task_id, record.response_id, claim.last_event_id)
            outcome = await run.execute(history, claim.cancel_requested)
            await self._announce(task_id)
            return outcome
        except asyncio.CancelledError:
            handed_back = True
            await asyncio.shield(self._hand_back(run, record.model))
            raise
        finally:
            if trace is not None:
                trace.close("handed_back" if handed_back else str(run.outcome or "stopped"), run.output_tokens,
                            run.cached_tokens)
            self._ended[job_id] = JobEnd(record.owner, run.tokens_used, handed_back)
            self.runs.pop(task_id, None)
            self.jobs.pop(task_id, None)
            async with self._changed:
                self._changed.notify_all()

    async def _announce(self, task_id: str) -> None:
        """Tell the API that the task ended (``lmsp_core.store.tasks.finished``); if Redis is away, the
        reaper tells it when it drops the final task from its index."""
        try:
            await finished.announce(self.redis, [task_id])
        except (RedisError, OSError) as exc:
            logger.warning("task %s: could not announce its end (%s)", task_id, type(exc).__name__)

    async def _last_output(self, record: TaskRecord) -> list[wire.OutputItem]:
        """What the task's stored events delivered, when this claim is the one that gives it up (its
        failed response keeps them); else nothing, without reading the log."""
        if record.attempts < self.settings.max_attempts:
            return []
        stored = await load_history(self.redis, record.id, record.response_id, record.last_event_id)
        return stored.delivered.items()

    async def idle(self) -> None:
        """Return once no task runs here."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self.runs)

    async def _hand_back(self, run: TaskRun, model_id: str) -> None:
        try:
            async with asyncio.timeout(HAND_BACK_LIMIT):
                await run.hand_back()
        except TimeoutError:  # Redis is away: leave the task to a reaper, from what is stored
            self.writer.close(run.task_id)
            logger.warning("task %s: could not store its last events; its lease will lapse", run.task_id)
            return
        try:
            await self.store.release(run.task_id, run.lease)
            await queue.wake(self.redis, model_id)  # arq keeps the job queued: another worker takes it
        except RedisError:
            logger.warning("task %s: could not release its lease; it will lapse", run.task_id)
        else:
            logger.info("task %s: handed back", run.task_id)

    # --- background duties ---------------------------------------------------------------------

    async def heartbeat(self) -> None:
        while True:
            try:
                await self.beat()
            except (RedisError, OSError) as exc:
                logger.warning("heartbeat failed: %s", type(exc).__name__)
            await asyncio.sleep(self.settings.worker_heartbeat)

    async def beat(self) -> None:
        """Heartbeat, with the running count and the metrics gathered since the last one."""
        running = Counter(run.record.model for run in self.runs.values())
        slots, used = {}, {}
        for model_id, runtime in self.runtimes.items():
            used[model_id], slots[model_id], _ = runtime.engine.occupancy()
            for rows, steps in runtime.engine.take_step_sizes().items():
                self.metrics.observe(metrics.BATCH_SIZE, (model_id,), rows, steps)
        info = msgspec.structs.replace(self.info, running=dict(running), slots=slots, slots_used=used)
        async with self.redis.pipeline(transaction=False) as pipe:
            registry.add_heartbeat(pipe, info, self.settings.worker_ttl)
            taken = self.metrics.add_to(pipe)
            try:
                await pipe.execute()
            except BaseException:
                self.metrics.restore(taken)
                raise

    async def renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_ttl / 3)
            try:
                lost = await self.store.renew({task_id: run.lease for task_id, run in self.runs.items()})
                await self._renew_running()
            except (RedisError, OSError) as exc:
                logger.warning("lease renewal failed: %s", type(exc).__name__)
                continue
            for task_id in lost:
                run = self.runs.get(task_id)
                if run is not None and run.outcome is None:
                    logger.warning("task %s: lease lost; stopping", task_id)
                    self.writer.close(task_id)
                    run.on_fenced()

    async def _renew_running(self) -> None:
        """Keep the fair queue's running entries of this worker's jobs (``max_running`` counts them)."""
        if not self.settings.fair_share:
            return
        for model_id in self.runtimes:
            running = [(run.record.owner, self.jobs[task_id]) for task_id, run in self.runs.items()
                       if run.record.model == model_id and task_id in self.jobs]
            await self.store.fair.renew(model_id, running, self.store.lease_ttl_ms)


def _setter(event: asyncio.Event) -> notices.Handler:
    return lambda _: event.set()
