"""The whole flow across two API processes and two workers sharing one Redis, with short retention;
and the same on a Redis Cluster of three shards."""

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import httpx
import pytest
import pytest_asyncio

from lmsp_core import wire
from lmsp_core.settings import load_settings
from lmsp_core.store import connections, keys
from tests.backends import BACKENDS
from tests.rediscluster import LocalCluster
from tests.support import (
    Api,
    RedisServer,
    Worker,
    assert_complete_log,
    assert_problem,
    body,
    collect,
    logged,
    sse_events,
    start_all,
    stop_all,
)

RETENTION = 3


class Cluster:
    def __init__(self, a: httpx.AsyncClient, b: httpx.AsyncClient, redis: RedisServer | LocalCluster,
                 workers: list[Worker]) -> None:
        self.a, self.b, self.redis, self.workers = a, b, redis, workers


@pytest_asyncio.fixture(scope="module", params=BACKENDS)
async def cluster(models_file: str, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    redis: RedisServer | LocalCluster = RedisServer() if request.param == "redis" else LocalCluster(replicas=0)
    await asyncio.to_thread(redis.start)
    url, where = redis.settings["redis_url"], {k: v for k, v in redis.settings.items() if k != "redis_url"}
    settings = {"models_file": models_file, "event_retention": RETENTION, **where}
    apis = [Api(url, **settings) for _ in range(2)]
    # tiny-serial runs one task at a time on each worker (test_both_workers_take_tasks)
    workers = [Worker(url, ["tiny-random", "tiny-serial"], **settings) for _ in range(2)]
    try:
        await start_all(*apis, *workers)  # side by side
        async with httpx.AsyncClient(base_url=apis[0].url, timeout=60) as a, \
                httpx.AsyncClient(base_url=apis[1].url, timeout=60) as b:
            yield Cluster(a, b, redis, workers)
    finally:
        stop_all(*apis, *workers)
        redis.cleanup()


async def test_follow_on_one_api_and_resume_on_the_other(cluster: Cluster) -> None:
    task = (await cluster.a.post("/lmsp/v1/tasks", json=body(max_output_tokens=500))).json()
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    first = []
    async with aclosing(sse_events(cluster.b, "GET", url)) as events:  # closed when left, not when collected
        async for event in events:
            first += logged([event])
            if len(first) == 20:
                break
    rest = logged(await collect(cluster.a, "GET", url, headers={"Last-Event-ID": "20"}))
    assert_complete_log(first + rest)
    state = (await cluster.b.get(f"/lmsp/v1/tasks/{task['id']}")).json()
    assert state["status"] == "incomplete"


async def until_running(client: httpx.AsyncClient, task_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (await client.get(f"/lmsp/v1/tasks/{task_id}")).json()["status"] == "queued":
        assert time.monotonic() < deadline, "the task was never taken"
        await asyncio.sleep(0.05)


async def test_both_workers_take_tasks(cluster: Cluster) -> None:
    # each worker runs one tiny-serial task at a time: while one of them runs the first (long) task,
    # only the other can take the second, however fast either polls its queue
    first = (await cluster.a.post("/lmsp/v1/tasks", json=body(model="tiny-serial", max_output_tokens=30000))).json()
    await until_running(cluster.b, first["id"])
    second = (await cluster.b.post("/lmsp/v1/tasks", json=body(model="tiny-serial", max_output_tokens=20))).json()
    assert_complete_log(logged(await collect(cluster.a, "GET", f"/lmsp/v1/tasks/{second['id']}/events")))
    assert (await cluster.b.post(f"/lmsp/v1/tasks/{first['id']}/cancel")).json()["status"] == "cancelled"
    client = connections.connect(load_settings({}, **cluster.redis.settings))
    try:
        claimed_by = {await client.hget(keys.task(t["id"]), "worker") for t in (first, second)}
    finally:
        await connections.close(client)
    assert len(claimed_by) == 2 and None not in claimed_by


async def test_cancel_from_the_other_api(cluster: Cluster) -> None:
    running = (await cluster.a.post("/lmsp/v1/tasks", json=body(max_output_tokens=1000))).json()
    async with aclosing(sse_events(cluster.a, "GET", f"/lmsp/v1/tasks/{running['id']}/events")) as events:
        async for event in events:
            if event.id == 3:
                break
    queued = (await cluster.a.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"))).json()
    for task in (running, queued):
        cancelled = (await cluster.b.post(f"/lmsp/v1/tasks/{task['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled"
        log = logged(await collect(cluster.a, "GET", f"/lmsp/v1/tasks/{task['id']}/events"))
        assert log[-1].event == wire.CANCELLED


async def test_expired_events_give_410_and_the_result_stays(cluster: Cluster) -> None:
    task = (await cluster.a.post("/lmsp/v1/tasks", json=body(max_output_tokens=5))).json()
    log = logged(await collect(cluster.b, "GET", f"/lmsp/v1/tasks/{task['id']}/events"))
    assert_complete_log(log)
    await asyncio.sleep(RETENTION + 0.5)
    for client in (cluster.a, cluster.b):
        assert_problem(await client.get(f"/lmsp/v1/tasks/{task['id']}/events"), 410, "event_history_expired")
        assert_problem(await client.get(f"/lmsp/v1/tasks/{task['id']}/events?after=2"), 410,
                       "event_history_expired")
        # at the end of the log there is nothing to replay: an empty stream, not an error
        assert await collect(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events?after={log[-1].id}") == []
        result = (await client.get(f"/lmsp/v1/tasks/{task['id']}")).json()
        assert result["status"] == "incomplete"
        assert result["response"]["output"][0]["content"][0]["text"] == "".join(
            e.data["delta"] for e in log if e.event == wire.TEXT_DELTA)
