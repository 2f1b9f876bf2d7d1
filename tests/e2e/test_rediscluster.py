"""The service on a Redis Cluster of three shards, each a primary and a replica (``tests/rediscluster.py``):
two API processes and two workers that know only some of its nodes.

What docs/reliability.md ("Redis Cluster") promises, checked here: tasks spread their events over
the shards; when a shard's primary is killed with SIGKILL mid-generation its replica is promoted,
every task ends exactly once, every follower resumes gapless with the text of an uninterrupted run,
and new requests succeed after the promotion; a killed worker's task still ends once; ``lmsp
token`` works on the cluster; what a cluster cannot do fails at start. The figures are printed:
``pytest -s tests/e2e/test_rediscluster.py``. (The store's other end-to-end tests run on such a
cluster too: ``tests/backends.py``.)
"""

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from lmsp_core.settings import load_settings
from lmsp_core.store import cluster, connections, keys
from tests.failover import MODEL, TASKS, Follower, check, generate_through, new_requests_succeed, request, serving
from tests.faults import Group, assert_exactly_once, text_of
from tests.rediscluster import LocalCluster
from tests.support import Api, assert_problem, body, free_port, run_lmsp, service_env, wait_for

SPREAD_TASKS = 900  # random ids: a shard's share of 900 is within 20% of a third but for 1 run in 10,000


@pytest_asyncio.fixture(scope="module")
async def group() -> AsyncIterator[Group]:
    nodes = LocalCluster(primaries=3, replicas=1)
    try:
        await asyncio.to_thread(nodes.start)
    except BaseException:
        nodes.stop()
        raise
    async with serving(nodes) as group:
        yield group


@pytest_asyncio.fixture(scope="module")
async def references(group: Group) -> list[str]:
    return list(await asyncio.gather(*(group.reference(request(i)) for i in range(TASKS))))


def nodes_of(group: Group) -> LocalCluster:
    assert isinstance(group.redis_server, LocalCluster)
    return group.redis_server


async def test_the_service_runs_on_the_cluster_client(group: Group) -> None:
    """A task runs, and its arq job ends cleanly: every transaction of arq's is within its queue's slot."""
    assert isinstance(group.redis, cluster.ClusterClient)
    task_id = await group.create(body(MODEL, "Hello", max_output_tokens=5))
    assert_exactly_once(await group.log(task_id))
    job = keys.job_id(task_id, MODEL)

    async def job_gone() -> bool:
        left = await group.redis.exists(*keys.arq_job_keys(job)) + await group.redis.zcard(keys.queue(MODEL))
        return int(left) == 0

    await wait_for(job_gone, timeout=30, what="the job's end")


@pytest.mark.timeout(600)
async def test_tasks_spread_their_events_over_the_shards(group: Group) -> None:
    nodes = nodes_of(group)
    started = time.monotonic()
    ids = await _create_and_finish(group, asyncio.Semaphore(32))
    events: Counter[int] = Counter()
    for task_id in ids:
        port, _ = await asyncio.to_thread(nodes.primary_of, keys.events(task_id))
        events[port] += int(await group.redis.xlen(keys.events(task_id)))
    mean = sum(events.values()) / len(events)
    shares = {port: round(count / mean, 3) for port, count in events.items()}
    print(f"\n{SPREAD_TASKS} tasks in {time.monotonic() - started:.1f} s; events per shard {dict(events)}, "
          f"share of the mean {shares}")
    assert len(events) == 3
    assert all(0.8 <= share <= 1.2 for share in shares.values()), shares


async def _create_and_finish(group: Group, semaphore: asyncio.Semaphore) -> list[str]:
    """``SPREAD_TASKS`` short synchronous responses; the ids of their tasks."""
    async def one(i: int) -> str:
        async with semaphore:
            response = await group.http.post("/lmsp/v1/tasks", json=body(MODEL, f"Spread {i}", max_output_tokens=2))
            assert response.status_code == 202, response.text
            task_id = str(response.json()["id"])
            assert_exactly_once(await group.log(task_id))
            return task_id

    return list(await asyncio.gather(*(one(i) for i in range(SPREAD_TASKS))))


@pytest.mark.timeout(600)
async def test_a_shard_primary_dies_mid_generation_and_its_replica_takes_over(
        group: Group, references: list[str]) -> None:
    nodes = nodes_of(group)
    # the shard of the first task's model queue: arq's, the fair queue's and the wake channel's
    victim_port, _ = await asyncio.to_thread(nodes.primary_of, keys.queue(MODEL))
    promoted: list[float] = []
    on_victim: list[str] = []

    class Victim:
        def stop(self, sig: int = signal.SIGTERM) -> None:
            nodes.kill(victim_port, sig)

    async def note_victims(followers: list[Follower]) -> None:
        for follower in followers:
            port, _ = await asyncio.to_thread(nodes.primary_of, keys.task(follower.task_id))
            if port == victim_port:
                on_victim.append(follower.task_id)

    async def failover(_: list[Follower]) -> None:
        await asyncio.to_thread(nodes.wait_promoted, victim_port)
        promoted.append(time.monotonic())

    outcome = await generate_through(group, Victim(), note_victims, failover)
    figures = await check(group, outcome, references)
    print(f"\nprimary of the queue's shard killed: {figures}, promotion seen after "
          f"{promoted[0] - outcome.killed_at:.2f} s; {len(on_victim)} of {TASKS} tasks on that shard")
    interrupted = {f.task_id for f in outcome.followers if f.interruptions}
    assert set(on_victim) <= interrupted  # their streams broke and came back
    await new_requests_succeed(group, group.apis)
    assert all(worker.process is not None and worker.process.poll() is None for worker in group.workers)


async def test_a_killed_workers_task_ends_once_on_the_cluster(group: Group) -> None:
    reference = await group.reference(body(MODEL, "Once more", max_output_tokens=400))
    task_id = await group.create(body(MODEL, "Once more", max_output_tokens=400))
    await wait_for(lambda: _has_events(group, task_id, 5), timeout=60, what="events")
    holder = await group.holder(task_id)
    holder.kill()
    log = await group.log(task_id)
    assert_exactly_once(log)
    assert text_of(log) == reference
    assert await group.attempts(task_id) == 2
    holder.start()
    await holder.ready()


async def _has_events(group: Group, task_id: str, count: int) -> bool:
    return int(await group.redis.xlen(keys.events(task_id))) >= count


def test_lmsp_token_works_on_the_cluster(group: Group) -> None:
    flags = ["--redis-cluster", nodes_of(group).settings["redis_cluster"]]
    env = service_env(nodes_of(group).settings["redis_url"])
    created = run_lmsp("token", "create", "--principal", "sharded", "--scopes", "tasks:read", *flags, env=env)
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() and "warning" not in created.stderr  # the {auth} shard's replica confirmed it
    listed = run_lmsp("token", "list", *flags, env=env)
    assert listed.returncode == 0 and "\tsharded\ttasks:read\t" in listed.stdout, listed.stderr


async def test_acknowledged_writes_wait_for_their_shards_replica(group: Group) -> None:
    settings = load_settings({}, **nodes_of(group).settings)
    client = connections.connect(settings)
    try:
        watch = connections.ReplicaWatch(settings)
        assert watch.wanted == 1
        assert await connections.replicated(client, watch, keys.task("any"))
    finally:
        await connections.close(client)


@pytest.mark.parametrize(("settings", "message"), [
    ({"redis_url": "redis://127.0.0.1:1/3"}, "database 0 only"),
    ({"redis_sentinels": "127.0.0.1:26379"}, "exclude each other"),
])
def test_what_a_cluster_cannot_do_fails_at_start(group: Group, settings: dict[str, str], message: str) -> None:
    env = service_env(settings.pop("redis_url", nodes_of(group).settings["redis_url"]),
                      redis_cluster=nodes_of(group).settings["redis_cluster"], **settings)
    run = subprocess.run([sys.executable, "-m", "lmsp.cli", "worker", "--model", MODEL], capture_output=True, text=True,
                         env=env, timeout=60)
    assert run.returncode != 0
    assert message in run.stderr, run.stderr[-2000:]


async def test_transactions_and_pipelined_scripts_on_the_cluster(group: Group) -> None:
    """The few places that need one Redis: a WATCHed transaction on the node of its keys, and
    scripts in a pipeline that the primaries forgot (as a promoted replica has none)."""
    client = connections.connect(load_settings({}, **nodes_of(group).settings))
    assert isinstance(client, cluster.ClusterClient)
    try:
        names = [f"lmsp:test:{{t{i}}}" for i in range(12)]  # over every shard
        for name in names:
            async with client.pipeline(transaction=True) as pipe:
                await pipe.watch(name)
                assert await pipe.get(name) is None
                pipe.multi()
                pipe.set(name, b"1")
                pipe.expire(name, 60)
                assert await pipe.execute() == [True, True]
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        await client.script_flush()
        async with client.pipeline(transaction=False) as pipe:
            for name in names:
                cluster.evalsha(pipe, script, [name], [])
            assert await pipe.execute() == [2] * len(names)
        assert len(await client.shards_of(names)) == 3
    finally:
        await connections.close(client)


async def test_a_cluster_that_no_node_answers_is_an_outage() -> None:
    """As for one Redis that is away: a problem document with 503, not an error of the service's."""
    nodes = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"  # nothing listens there
    api = Api("redis://127.0.0.1:1/0", redis_cluster=nodes).start()
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
            assert_problem(await client.post("/lmsp/v1/tasks", json=body(MODEL, "Hello")), 503, "service_unavailable")
    finally:
        api.stop()
    assert "Traceback" not in api.output()
