"""The job queue: one arq queue per model; a job carries only the task id.

A queue is a sorted set that workers read in score order. A job's score is its task's creation
time (ms) moved into the past by its priority: ``high`` by two ``LMSP_PRIORITY_STEP``s, ``normal``
by one, ``low`` not at all. So a high-priority request starts before lower ones created up to that
long before it, and a waiting task ages: once it has waited longer than the difference, it comes
before new work of every priority (docs/protocol.md, "Priorities").

Delivery is at least once: arq may run a job twice (a worker restart, a lapsed lease), so the
job's first step is an atomic claim on the task record (see ``tasks.TaskStore.claim``).
After each enqueue a message on the model's wake channel lets idle workers poll at once instead
of after their poll delay.

Which waiting job starts next is the fair queue's choice (``fairqueue``): each job is admitted there
too, for its principal, and workers start the jobs it picks; with ``LMSP_FAIR_SHARE=0`` they start
jobs in score order, as arq reads them.

A task's first job has the id ``keys.job_id`` (the task's id and its model's hash tag); a reaper
that finds a task nobody runs gives it a fresh job (``<first job id>:<n>``, see
``scripts.REQUEUE``) at the same place and removes the old one, which a
killed worker leaves marked as running until arq's own in-progress expiry (the job time limit plus
a minute).

On Redis Cluster arq runs on a connection to the primary of its model's queue slot
(``cluster.ClusterClient.pinned``): its transactions are over keys of that slot only.
"""

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import NamedTuple, cast

from arq.connections import ArqRedis
from redis.asyncio import Redis

from lmsp_core.store import cluster, keys
from lmsp_core.store.tasks.fairqueue import FairQueue
from lmsp_core.store.tenants import principals
from lmsp_core.wire.extensions import Priority

GENERATE = "generate"
JOB_EXPIRY = timedelta(days=1)  # arq's default; set explicitly, since arq shortens it for past scores

_STEPS: dict[Priority, int] = {"high": 2, "normal": 1, "low": 0}


def score(created_at: float, priority: Priority, step: float) -> datetime:
    """When the job counts as queued: its creation time moved into the past by its priority."""
    return datetime.fromtimestamp(created_at - _STEPS[priority] * step, tz=UTC)


class Ticket(NamedTuple):
    """What the fair queue needs to know of a job: whose it is, what it costs, and the principal's
    quota of waiting jobs (None: none, or not checked: a job the reaper replaces)."""

    principal: str
    cost: int
    max_queued: int | None = None


async def enqueue(pool: ArqRedis, task_id: str, model_id: str, queued_at: datetime | None = None, *,
                  job_id: str | None = None, fair: tuple[FairQueue, Ticket] | None = None) -> bool:
    """Add the task's job to its model's queue at ``queued_at`` (its place, see ``score``; default
    now) and, with ``fair``, admit it to the fair queue. False (and nothing queued) when the
    principal has its ``max_queued`` waiting jobs already. A job id that exists already is not
    queued twice."""
    job_id = job_id or keys.job_id(task_id, model_id)
    queued_at = queued_at or datetime.now(UTC)
    await arq_client(pool, model_id).enqueue_job(GENERATE, task_id, _job_id=job_id, _queue_name=keys.queue(model_id),
                           _defer_until=queued_at, _expires=JOB_EXPIRY)
    # admitted after arq has it, so a worker never picks a job that arq cannot start yet
    if fair is not None:
        fair_queue, ticket = fair
        if not await fair_queue.admit(model_id, job_id, ticket.principal, queued_at, ticket.cost, ticket.max_queued):
            await withdraw(pool, job_id, model_id)
            return False
    await wake(pool, model_id)
    return True


def arq_client(redis: Redis, model_id: str) -> ArqRedis:
    """The client that arq uses for the model's queue: on a cluster, one of its slot's primary."""
    if isinstance(redis, cluster.ClusterClient):
        return redis.pinned(keys.queue(model_id))
    return cast(ArqRedis, redis)


async def wake(redis: Redis, model_id: str) -> None:
    """Tell the model's idle workers to poll now (on a cluster with a sharded message, which only
    the queue's shard carries)."""
    if isinstance(redis, cluster.ClusterClient):
        await redis.execute_command("SPUBLISH", keys.wake_channel(model_id), "")
    else:
        await redis.publish(keys.wake_channel(model_id), "")


async def pending(pool: ArqRedis, model_id: str, job_ids: Sequence[str]) -> list[bool]:
    """For each job: whether it waits in the queue, so that a worker will start it (it is queued
    and not marked as running)."""
    async with pool.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.zscore(keys.queue(model_id), job_id)
            pipe.exists(keys.arq_in_progress(job_id))
        replies = await pipe.execute()
    return [score is not None and not running for score, running in zip(replies[::2], replies[1::2], strict=True)]


async def drop(pool: ArqRedis, model_id: str, job_id: str) -> None:
    """Remove a job from the queue and forget it (a job whose worker died)."""
    async with pool.pipeline(transaction=True) as pipe:
        pipe.zrem(keys.queue(model_id), job_id)
        pipe.delete(*keys.arq_job_keys(job_id))
        FairQueue(pool).drop_in(pipe, model_id, job_id)
        await pipe.execute()


async def queue_position(pool: ArqRedis, task_id: str, model_id: str, job_id: str | None = None, *,
                         fair: bool = True) -> int | None:
    """1-based place of the task's job in its model's queue, or None once it has left it: with
    ``fair``, its place in the fair order (``FairQueue.position``); else, or for a job the fair
    queue does not hold, its rank by score."""
    job_id = job_id or keys.job_id(task_id, model_id)
    if fair:
        place = await FairQueue(pool).position(model_id, job_id, await principals.load(pool))
        if place is not None:
            return place
    rank = await pool.zrank(keys.queue(model_id), job_id)
    return None if rank is None else int(rank) + 1


async def depth(pool: ArqRedis, model_id: str) -> int:
    return int(await pool.zcard(keys.queue(model_id)))


async def withdraw(redis: Redis, job_id: str, model_id: str) -> None:
    """Take a cancelled task's job out of its queue, so that it neither counts in the queue depth
    nor waits for a worker to pop it (a model without workers would keep it forever)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrem(keys.queue(model_id), job_id)
        pipe.delete(keys.arq_job(job_id))
        FairQueue(redis).drop_in(pipe, model_id, job_id)
        await pipe.execute()
