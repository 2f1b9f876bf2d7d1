"""The reaper: gives tasks that nobody runs any more back to the queue, within seconds.

A worker killed with SIGKILL (or cut off from Redis) leaves its tasks ``in_progress`` under a lease
that nobody renews, and arq would re-run their jobs only when its own in-progress marker expires
(the job time limit plus a minute). Every worker therefore reaps, for its models: it takes the due
entries of the index of unfinished tasks (``lmsp_core.store.tasks.taskindex``), reads each task's hash and

- drops the entry of a task that is final or gone, announcing a final one's end
  (``lmsp_core.store.tasks.finished``: its worker may have died before it did);
- looks again when the lease of a running task would lapse;
- gives a task that nobody holds (queued, or in progress with a lapsed lease) a fresh arq job at
  the task's own place in the queue (its creation time and priority), unless its current job still
  waits in the queue, and removes the dead job;
- makes sure a job that waits in the arq queue also waits in the fair queue (``FairQueue.admit``):
  a worker that died between picking a job and starting it leaves it in neither.

The job's claim is atomic, so a task queued twice (two reapers, a reaper and an API that was
slow to enqueue) still runs once; the index's take step keeps reapers from doing the same work.
"""

import asyncio
import logging
from collections.abc import Callable, Collection
from datetime import datetime

import msgspec
from arq.connections import ArqRedis
from redis.exceptions import RedisError

from lmsp_core import wire
from lmsp_core.requests import extensions
from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.tasks import fairqueue, finished, queue
from lmsp_core.store.tasks.records import TaskRecord, TaskStore

logger = logging.getLogger(__name__)

TAKE_LIMIT = 100
UNKNOWN_COST = 1024  # what a task whose record predates costs is charged (tokens)
_FIELDS = ["status", "lease_until", "job"]


class Reaper:
    def __init__(self, pool: ArqRedis, store: TaskStore, settings: Settings, model_ids: Collection[str],
                 held_here: Callable[[], Collection[str]]) -> None:
        self.pool = pool
        self.store = store
        self.settings = settings
        self.model_ids = list(model_ids)
        self.held_here = held_here  # tasks this worker runs: alive by definition, never reaped here
        self.lease_ms = store.lease_ttl_ms
        # a task whose job waits in the queue, or that this worker runs, is looked at again later
        self.recheck_ms = 3 * self.lease_ms

    async def run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.settings.reaper_interval)
            try:
                for model_id in self.model_ids:
                    while len(await self.sweep(model_id)) == TAKE_LIMIT:
                        pass
            except (RedisError, OSError) as exc:
                if not failing:
                    logger.warning("reaper: Redis unavailable (%s); retrying", type(exc).__name__)
                failing = True
            else:
                failing = False

    async def sweep(self, model_id: str) -> list[str]:
        """Look at the model's due tasks once; returns the ids looked at."""
        now, due = await self.store.index.take(model_id, TAKE_LIMIT, hold_ms=self.recheck_ms)
        if not due:
            return due
        async with self.pool.pipeline(transaction=False) as pipe:
            for task_id in due:
                pipe.hmget(keys.task(task_id), _FIELDS)
            states = await pipe.execute()
        next_look: dict[str, int] = {}
        drop: list[str] = []
        ended: list[str] = []
        orphans: dict[str, str] = {}  # task id -> its current job
        held_here = self.held_here()
        for task_id, (status, lease_until, job) in zip(due, states, strict=True):
            lease_end = int(lease_until or 0)
            if status is None or status.decode() in wire.FINAL_STATUSES:
                drop.append(task_id)
                if status is not None:
                    ended.append(task_id)
            elif status == b"in_progress" and lease_end >= now:
                next_look[task_id] = lease_end + 1
            elif task_id in held_here:
                next_look[task_id] = now + self.lease_ms  # our renewal is late (Redis was away)
            else:
                orphans[task_id] = job.decode() if job else keys.job_id(task_id, model_id)
        for task_id in await self._requeue(model_id, orphans):
            next_look[task_id] = now + self.recheck_ms
        # announced before the entry goes: a reaper that dies in between leaves it to the next one
        await finished.announce(self.pool, ended)
        await self.store.index.settle(model_id, next_look, drop)
        return due

    async def _requeue(self, model_id: str, orphans: dict[str, str]) -> list[str]:
        if not orphans:
            return []
        waiting = await queue.pending(self.pool, model_id, list(orphans.values()))
        for (task_id, old_job), queued in zip(orphans.items(), waiting, strict=True):
            record = await self.store.get(task_id)
            if record is None:
                continue
            if queued:  # a worker will start its job (a task handed back on shutdown, or queued)
                if self.settings.fair_share:
                    await self.store.fair.admit(model_id, old_job, record.owner, self._place(record), _cost(record))
                continue
            job = await self.store.requeue(task_id, model_id)
            if job is None:
                continue  # claimed or finished meanwhile
            fair = (self.store.fair, queue.Ticket(record.owner, _cost(record))) if self.settings.fair_share else None
            await queue.enqueue(self.pool, task_id, model_id, self._place(record), job_id=job, fair=fair)
            await queue.drop(self.pool, model_id, old_job)
            logger.info("task %s: nobody runs it; queued again as job %s", task_id, job)
        return list(orphans)

    def _place(self, record: TaskRecord) -> datetime:
        request = msgspec.json.decode(record.request, type=wire.ResponseRequest)
        priority = extensions.priority(request, direct=record.kind == "direct")
        return queue.score(record.created_at, priority, self.settings.priority_step)


def _cost(record: TaskRecord) -> int:
    return record.cost or fairqueue.cost(0, UNKNOWN_COST)
