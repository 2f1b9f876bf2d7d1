"""The reaper's sweep against a real Redis: what it does with each kind of task it finds due in
the index of unfinished tasks."""

import redis.asyncio as aioredis
from arq.connections import ArqRedis

from lmsp_core.settings import Settings
from lmsp_core.store import connections, keys
from lmsp_core.store.tasks import queue
from lmsp_core.store.tasks.records import TaskStore
from tests.unit.tasks import claimed, lapse, new_task
from workers.reaper import Reaper


async def _server_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_sweep(redis: aioredis.Redis, settings: Settings, model: str) -> None:
    pool: ArqRedis = connections.connect(settings)
    store = TaskStore(pool, settings)
    held: set[str] = set()
    reaper = Reaper(pool, store, settings, [model], held_here=lambda: held)
    try:
        finished = await new_task(store, model)
        await store.cancel(finished)
        gone = await new_task(store, model)
        await store.delete(gone)
        running = await new_task(store, model)
        await claimed(store, running, "live")
        mine = await new_task(store, model)  # this worker runs it; its renewal is late
        await claimed(store, mine, "mine")
        await lapse(redis, mine)
        held.add(mine.id)
        orphan = await new_task(store, model, extensions={"x-priority": "high"})  # its worker died
        await queue.enqueue(pool, orphan.id, model)
        await claimed(store, orphan, "dead")
        await pool.set(keys.arq_in_progress(keys.job_id(orphan.id, model)), b"1")  # arq still marks its job as running
        await lapse(redis, orphan)
        waiting = await new_task(store, model)  # handed back on shutdown: its job waits in the queue
        await queue.enqueue(pool, waiting.id, model)
        lost = await new_task(store, model)  # the API died before it queued the job
        tasks = [finished, gone, running, mine, orphan, waiting, lost]
        for record in tasks:
            await store.index.add(model, record.id, 0)  # due now

        before = await _server_ms(redis)
        assert sorted(await reaper.sweep(model)) == sorted(record.id for record in tasks)
        after = await _server_ms(redis)
        looks = await store.index.entries(model)

        assert finished.id not in looks and gone.id not in looks
        # the end of a final task it drops is announced again (its worker may have died before it did;
        # here the cancel announced it first)
        announced = [fields[b"task"].decode() for _, fields in await redis.xrevrange(keys.finished(), count=1000)]
        assert announced.count(finished.id) == 2 and gone.id not in announced and running.id not in announced
        lease_until = int(await redis.hget(keys.task(running.id), "lease_until"))  # type: ignore[misc]
        assert looks[running.id] == lease_until + 1
        assert before + reaper.lease_ms <= looks[mine.id] <= after + reaper.lease_ms
        for record in (orphan, waiting, lost):
            assert before + reaper.recheck_ms <= looks[record.id] <= after + reaper.recheck_ms
        assert await reaper.sweep(model) == []  # nothing due: each was looked at just now

        queued = {job.decode(): score for job, score in await pool.zrange(keys.queue(model), 0, -1, withscores=True)}
        # a fresh job for each task nobody holds and no job of which waits, at the task's own place
        first = {record.id: keys.job_id(record.id, model) for record in tasks}
        assert set(queued) == {f"{first[orphan.id]}:1", first[waiting.id], f"{first[lost.id]}:1"}
        place = queue.score(orphan.created_at, "high", settings.priority_step).timestamp() * 1000
        assert abs(queued[f"{first[orphan.id]}:1"] - place) <= 1
        for record in (orphan, lost):
            assert (await store.get(record.id)).job == f"{first[record.id]}:1"  # type: ignore[union-attr]
        assert (await store.get(waiting.id)).job is None  # type: ignore[union-attr]
        assert not await pool.exists(*keys.arq_job_keys(first[orphan.id]))  # the dead job is gone
        assert (await store.get(mine.id)).job == first[mine.id]  # type: ignore[union-attr]  # as its claim left it
        # and each waits in the fair queue too: the handed-back job (queued without it, as by a
        # worker that died between picking and starting it) admitted again; the high one first
        picked = await store.fair.pick(model, 10, 10_000, {})
        assert picked[0] == f"{first[orphan.id]}:1"
        assert sorted(picked[1:]) == sorted([f"{first[lost.id]}:1", first[waiting.id]])
    finally:
        await pool.aclose()
