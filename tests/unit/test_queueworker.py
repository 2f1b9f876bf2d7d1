"""``workers/queueworker.py`` against the installed arq: the internals it overrides and uses are
still there and behave as it assumes. A failure here means a newer arq changed them: read the
message, then revisit ``WakeableWorker`` and docs/queue.md before pinning the new arq."""

import asyncio
import inspect
from typing import Any

import arq
import pytest
from arq.connections import ArqRedis
from arq.worker import Worker, func
from redis.exceptions import RedisError

from lmsp_core.settings import Settings
from lmsp_core.store import keys
from tests.support import free_port
from tests.unit.tasks import model_id
from workers.queueworker import ARQ_ATTRIBUTES, ARQ_INTERNALS, WakeableWorker

ARQ = f"arq {arq.VERSION}"


async def _job(ctx: dict[str, Any], gate: str) -> str:
    await ctx["gates"][gate].wait()
    return gate


def _worker(pool: ArqRedis, max_jobs: int = 1, gates: dict[str, asyncio.Event] | None = None) -> WakeableWorker:
    return WakeableWorker(functions=[func(_job, name="job")], queue_name=keys.queue(model_id()), redis_pool=pool,
                          max_jobs=max_jobs, keep_result=0, wake=asyncio.Event(), ctx={"gates": gates or {}})


@pytest.mark.parametrize("name", sorted(ARQ_INTERNALS))
def test_the_methods_we_override_or_call_are_still_there(name: str) -> None:
    original = getattr(Worker, name, None)
    assert original is not None, f"{ARQ}: Worker.{name} is gone; WakeableWorker relies on it"
    parameters = tuple(inspect.signature(original).parameters)
    assert parameters == ARQ_INTERNALS[name], (
        f"{ARQ}: Worker.{name} now takes {parameters}, WakeableWorker expects {ARQ_INTERNALS[name]}")
    ours = getattr(WakeableWorker, name)
    if ours is not original:
        assert tuple(inspect.signature(ours).parameters) == parameters, f"WakeableWorker.{name} no longer matches arq's"
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(original), (
            f"{ARQ}: Worker.{name} changed between a coroutine and a plain function")


async def test_the_attributes_we_use_are_still_there(redis_url: str) -> None:
    pool = ArqRedis.from_url(redis_url)
    worker = _worker(pool, max_jobs=3)
    try:
        missing = [name for name in ARQ_ATTRIBUTES if not hasattr(worker, name)]
        assert not missing, f"{ARQ}: Worker no longer has {missing}; WakeableWorker relies on them"
        assert isinstance(worker.sem, asyncio.Semaphore), f"{ARQ}: Worker.sem is a {type(worker.sem)}"
        assert worker.job_counter == 0 and worker.tasks == {} and worker.allow_pick_jobs
    finally:
        await pool.aclose()


async def test_a_redis_error_while_starting_a_job_gives_its_slot_back() -> None:
    """arq takes the slot (semaphore and counter) before its Redis calls: WakeableWorker gives it
    back when one fails. If arq stopped taking it first, the counter would go below zero here, or the
    bounded semaphore would refuse the release (ValueError)."""
    pool = ArqRedis.from_url(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
    worker = _worker(pool, max_jobs=2)
    try:
        with pytest.raises((RedisError, OSError)):
            await worker.start_jobs([b"job-1"])
        assert worker.job_counter == 0, (f"{ARQ}: a job that failed to start left job_counter at {worker.job_counter}: "
                                         "arq's start_jobs no longer takes the slot where WakeableWorker expects")
        for _ in range(worker.max_jobs):  # every slot is free again
            assert not worker.sem.locked()
            await worker.sem.acquire()
        # and a failed poll is logged and retried, never raised: it would end arq's poll loop
        worker.wake.set()
        await worker._poll_iteration()
    finally:
        await pool.aclose()


async def test_jobs_start_only_into_free_slots_and_a_finished_one_wakes_the_poll(redis_url: str) -> None:
    pool = ArqRedis.from_url(redis_url)
    gates = {"a": asyncio.Event(), "b": asyncio.Event()}
    worker = _worker(pool, max_jobs=1, gates=gates)
    try:
        for gate in gates:
            await pool.enqueue_job("job", gate, _job_id=f"{worker.queue_name}-{gate}", _queue_name=worker.queue_name)
        queued = await pool.zrange(worker.queue_name, 0, -1)
        await worker.start_jobs(queued)
        assert list(worker.tasks) == [queued[0].decode()] and worker.job_counter == 1  # "b" waits in the queue
        gates["a"].set()
        await asyncio.wait_for(worker.tasks[queued[0].decode()], 10)
        await asyncio.sleep(0)  # the task's done callbacks
        assert worker.job_counter == 0, f"{ARQ}: a finished job no longer frees its slot"
        assert worker.wake.is_set(), f"{ARQ}: _release_sem_dec_counter_on_complete is no longer called"
    finally:
        gates["b"].set()
        for task in worker.running_jobs():
            task.cancel()
        await asyncio.gather(*worker.running_jobs(), return_exceptions=True)
        await pool.delete(worker.queue_name, *(keys.arq_job(f"{worker.queue_name}-{gate}") for gate in gates))
        await pool.aclose()


@pytest.fixture
def redis_url(settings: Settings) -> str:
    return settings.redis_url
