"""The fair queue's scripts against a real Redis: who a free slot goes to, quotas, refunds, the
reaper's restore of a lost pick, and a job that left the arq queue."""

import asyncio
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis

from lmsp_core.store import keys
from lmsp_core.store.tasks.fairqueue import FairQueue
from lmsp_core.store.tenants.principals import PrincipalSettings

LEASE_MS = 10_000
T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def _queue(redis: aioredis.Redis, fair: FairQueue, model: str, principal: str, jobs: list[str], *,
                 cost: int = 10, max_queued: int | None = None, at: datetime = T0) -> list[bool]:
    admitted = []
    for n, job in enumerate(jobs):
        place = at + timedelta(milliseconds=n)
        await redis.zadd(keys.queue(model), {job: place.timestamp() * 1000})  # the arq queue
        admitted.append(await fair.admit(model, job, principal, place, cost, max_queued))
    return admitted


async def test_a_second_principal_starts_next(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", [f"a{n}" for n in range(50)])
    assert await fair.pick(model, 2, LEASE_MS, {}) == ["a0", "a1"]
    await _queue(redis, fair, model, "b", ["b0", "b1", "b2"], at=T0 + timedelta(hours=1))
    # b starts from the virtual time: it alternates with a, despite a's 48 older jobs
    assert await fair.pick(model, 6, LEASE_MS, {}) == ["b0", "a2", "b1", "a3", "b2", "a4"]
    assert await fair.pick(model, 2, LEASE_MS, {}) == ["a5", "a6"]


async def test_weights_share_starts(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", [f"a{n}" for n in range(100)])
    await _queue(redis, fair, model, "b", [f"b{n}" for n in range(100)])
    picked = await fair.pick(model, 60, LEASE_MS, {"a": PrincipalSettings(weight=2)})
    assert sum(job.startswith("a") for job in picked) == 40


async def test_priority_orders_within_a_principal(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", ["late"], at=T0 + timedelta(seconds=5))
    await _queue(redis, fair, model, "a", ["early"], at=T0)  # e.g. high priority: placed earlier
    assert await fair.pick(model, 2, LEASE_MS, {}) == ["early", "late"]


async def test_max_running_leaves_jobs_waiting(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", [f"a{n}" for n in range(10)])
    await _queue(redis, fair, model, "b", [f"b{n}" for n in range(10)])
    table = {"a": PrincipalSettings(max_running=2)}
    picked = await fair.pick(model, 6, LEASE_MS, table)
    assert picked == ["a0", "b0", "a1", "b1", "b2", "b3"]
    await fair.finish(model, "a0", 10, 1.0)
    assert await fair.pick(model, 2, LEASE_MS, table) == ["a2", "b4"]
    shares = {share.principal: share for share in (await fair.shares([model]))[model]}
    assert (shares["a"].queued, shares["a"].running) == (7, 2)
    assert (shares["b"].queued, shares["b"].running) == (5, 5)


async def test_max_queued_refuses_and_repeats_are_idempotent(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    assert await _queue(redis, fair, model, "a", ["a0", "a1", "a2"], max_queued=2) == [True, True, False]
    assert await fair.admit(model, "a1", "a", T0, 10, 2)  # a repeat of an admitted job
    assert await fair.pick(model, 1, LEASE_MS, {}) == ["a0"]
    assert await _queue(redis, fair, model, "a", ["a3"], max_queued=2) == [True]


async def test_refund_and_hand_back(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", ["a0", "a1"], cost=100)
    await _queue(redis, fair, model, "b", ["b0", "b1"], cost=100)
    assert await fair.pick(model, 2, LEASE_MS, {}) == ["a0", "b0"]
    await fair.finish(model, "a0", 1, 1.0)  # a's task stopped after one token: charged 1, not 100
    await fair.finish(model, "b0", 100, 1.0, requeue=True)  # handed back: waits again
    assert await fair.pick(model, 3, LEASE_MS, {}) == ["a1", "b0", "b1"]


async def test_lost_pick_comes_back_once_its_entry_lapses(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", ["a0"])
    assert await fair.pick(model, 1, 1, {}) == ["a0"]  # its worker dies before starting it
    assert await fair.pick(model, 1, LEASE_MS, {}) == []
    await asyncio.sleep(0.01)
    assert await fair.admit(model, "a0", "a", T0, 10)  # the reaper's restore
    assert await fair.pick(model, 1, LEASE_MS, {}) == ["a0"]
    assert await fair.admit(model, "a0", "a", T0, 10)  # a live pick: left alone
    assert await fair.pick(model, 1, LEASE_MS, {}) == []


async def test_a_job_that_left_the_arq_queue_is_forgotten(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", ["a0", "a1", "a2"])
    await redis.zrem(keys.queue(model), "a0")  # cancelled, withdrawn by a process that died
    await fair.drop(model, "a1")  # withdrawn
    assert await fair.pick(model, 3, LEASE_MS, {}) == ["a2"]
    assert await redis.hkeys(keys.fair_queue(model)[4]) == [b"a2"]
    assert (await fair.shares([model]))[model][0].queued == 0


async def test_queue_position_follows_the_fair_order(redis: aioredis.Redis, model: str) -> None:
    fair = FairQueue(redis)
    await _queue(redis, fair, model, "a", [f"a{n}" for n in range(50)])
    assert await fair.pick(model, 2, LEASE_MS, {}) == ["a0", "a1"]
    await _queue(redis, fair, model, "b", ["b0", "b1", "b2"], at=T0 + timedelta(hours=1))
    # the two running jobs were queued before b's; then b0, a2, b1, a3, b2 start in turn
    assert [await fair.position(model, job, {}) for job in ("b0", "b1", "b2")] == [3, 5, 7]
    assert await fair.position(model, "a2", {}) == 4
    assert await fair.position(model, "a49", {}) == 2 + 47 + 3 + 1
    assert await fair.position(model, "a0", {}) is None  # running
    weighted = {"b": PrincipalSettings(weight=2)}
    assert [await fair.position(model, job, weighted) for job in ("b0", "b1", "b2")] == [3, 4, 6]
