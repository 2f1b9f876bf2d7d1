"""The whole flow across two API processes and two workers sharing one Redis, with short retention."""

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest_asyncio

from lmsp_core import wire
from tests.support import Api, RedisServer, Worker, body, collect, sse_events
from tests.test_errors import assert_problem
from tests.test_tasks import assert_complete_log, logged

RETENTION = 3


class Cluster:
    def __init__(self, a: httpx.AsyncClient, b: httpx.AsyncClient, redis: RedisServer,
                 workers: list[Worker]) -> None:
        self.a, self.b, self.redis, self.workers = a, b, redis, workers


@pytest_asyncio.fixture(scope="module")
async def cluster(models_file: str) -> AsyncIterator[Cluster]:
    redis = RedisServer()
    redis.start()
    settings = {"models_file": models_file, "event_retention": RETENTION}
    apis = [Api(redis.url, **settings).start() for _ in range(2)]
    workers = [Worker(redis.url, ["tiny-random"], **settings) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            await worker.ready()
        async with httpx.AsyncClient(base_url=apis[0].url, timeout=60) as a, \
                httpx.AsyncClient(base_url=apis[1].url, timeout=60) as b:
            yield Cluster(a, b, redis, workers)
    finally:
        for process in [*apis, *workers]:
            process.stop()
        redis.cleanup()


async def test_follow_on_one_api_and_resume_on_the_other(cluster: Cluster) -> None:
    task = (await cluster.a.post("/lmsp/v1/tasks", json=body(max_output_tokens=500))).json()
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    first = []
    async for event in sse_events(cluster.b, "GET", url):
        first += logged([event])
        if len(first) == 20:
            break
    rest = logged(await collect(cluster.a, "GET", url, headers={"Last-Event-ID": "20"}))
    assert_complete_log(first + rest)
    state = (await cluster.b.get(f"/lmsp/v1/tasks/{task['id']}")).json()
    assert state["status"] == "incomplete"


async def test_both_workers_take_tasks(cluster: Cluster) -> None:
    clients = [cluster.a, cluster.b]
    created = [(await clients[i % 2].post("/lmsp/v1/tasks", json=body(max_output_tokens=150))).json()
               for i in range(8)]
    logs = await asyncio.gather(*(collect(clients[(i + 1) % 2], "GET", f"/lmsp/v1/tasks/{t['id']}/events")
                                  for i, t in enumerate(created)))
    for log in logs:
        assert_complete_log(logged(log))
    client = cluster.redis.client()
    try:
        claimed_by = {await client.hget(f"lmsp:task:{{{t['id']}}}", "worker") for t in created}
    finally:
        await client.aclose()
    assert len(claimed_by) == 2


async def test_cancel_from_the_other_api(cluster: Cluster) -> None:
    running = (await cluster.a.post("/lmsp/v1/tasks", json=body(max_output_tokens=1000))).json()
    async for event in sse_events(cluster.a, "GET", f"/lmsp/v1/tasks/{running['id']}/events"):
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
