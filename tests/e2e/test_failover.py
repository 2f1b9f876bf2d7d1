"""Redis fails over: a primary, one replica and three sentinels (``tests/replication.py``), two API
processes and two workers that know only the sentinels. Eight tasks generate, each with a follower
on the API it was not created on, when the replica (first test) or the primary (second test) is
killed with SIGKILL.

What docs/reliability.md ("Replication and failover") promises, checked here: every task ends with
exactly one final event; a follower that reconnects with ``Last-Event-ID`` gets a gapless log with no
event twice, every event it saw is the stored one (none lost, none replaced after the failover),
and with greedy decoding the text equals an uninterrupted run; no task is taken over by another
worker (its events were on the replica before its worker moved on); new requests succeed after the
promotion; the killed node rejoins as a replica. The figures (seconds from the kill to the first
new event, what followers saw twice or lost) are printed: ``pytest -s tests/e2e/test_failover.py``.
"""

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from lmsp_core.settings import load_settings
from lmsp_core.store import connections, keys
from tests.failover import (
    TASKS,
    WAIT_TIMEOUT,
    Follower,
    check,
    generate_through,
    new_requests_succeed,
    request,
    serving,
)
from tests.faults import Group
from tests.replication import UNUSED_URL, ReplicatedRedis
from tests.support import run_lmsp, service_env, wait_for


@pytest_asyncio.fixture(scope="module")
async def group() -> AsyncIterator[Group]:
    redis = ReplicatedRedis()
    try:
        await redis.start()
    except BaseException:
        redis.cleanup()
        raise
    async with serving(redis) as group:
        yield group


@pytest_asyncio.fixture(scope="module")
async def references(group: Group) -> list[str]:
    """The uninterrupted text of each task's request."""
    return list(await asyncio.gather(*(group.reference(request(i)) for i in range(TASKS))))


async def test_a_client_asks_the_sentinels_and_closes_its_connections_to_them(group: Group) -> None:
    redis = group.redis_server
    assert isinstance(redis, ReplicatedRedis)
    settings = load_settings({}, **redis.settings)
    client = connections.connect(settings)
    assert await client.ping()
    assert (await client.execute_command("ROLE"))[0] == b"master"
    watch = connections.ReplicaWatch(settings)
    assert await watch.command(client) == ("WAIT", 1, 100) and watch.online == 1
    assert await connections.replicated(client, watch, keys.task("any"))  # the replica confirms
    sentinels = client.connection_pool.sentinel_manager.sentinels
    await client.aclose()
    for sentinel in sentinels:
        assert not any(c.is_connected for c in sentinel.connection_pool._available_connections)


def test_lmsp_token_finds_the_primary_through_the_sentinels(group: Group) -> None:
    redis = group.redis_server
    assert isinstance(redis, ReplicatedRedis)
    flags = ["--redis-url", redis.settings["redis_url"], "--redis-sentinels", redis.settings["redis_sentinels"],
             "--redis-master", redis.settings["redis_master"]]
    env = service_env(UNUSED_URL)
    created = run_lmsp("token", "create", "--principal", "failover", "--scopes", "tasks:read", *flags, env=env)
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() and "warning" not in created.stderr  # a replica confirmed it
    listed = run_lmsp("token", "list", *flags, env=env)
    assert listed.returncode == 0 and "\tfailover\ttasks:read\t" in listed.stdout, listed.stderr


@pytest.mark.timeout(600)
async def test_the_replica_dies_mid_generation_and_the_service_keeps_running(
        group: Group, references: list[str]) -> None:
    redis = group.redis_server
    assert isinstance(redis, ReplicatedRedis)
    primary = await redis.primary()
    replica = redis.other(primary)
    outcome = await generate_through(group, replica)
    figures = await check(group, outcome, references)
    gaps = [later - earlier for f in outcome.followers for earlier, later in itertools.pairwise(f.arrivals)
            if later > outcome.killed_at]
    print(f"\nreplica killed: {figures}, longest wait between events after the kill {max(gaps):.2f} s")
    assert not any(f.interruptions for f in outcome.followers)  # the primary served everyone throughout
    assert await redis.primary() is primary
    await new_requests_succeed(group, group.apis[:1])  # each waits out the WAIT timeout: one will do
    assert any("not reaching 1 replica(s)" in worker.output() for worker in group.workers)  # WAIT gave up
    await redis.restart_as_replica(replica)


@pytest.mark.timeout(600)
async def test_the_primary_dies_mid_generation_and_the_replica_takes_over(
        group: Group, references: list[str]) -> None:
    """The replica lags when the primary dies (the proxy holds its replication stream back): the
    followers have seen events that the promoted replica never got. Their workers still hold them
    (not confirmed by WAIT) and write them again, so nobody sees a difference."""
    redis = group.redis_server
    assert isinstance(redis, ReplicatedRedis)
    primary = await redis.primary()
    replica = redis.other(primary)
    ahead: dict[str, int] = {}  # task -> events its follower saw that the replica lacked at the kill
    promoted: list[float] = []

    async def lag(followers: list[Follower]) -> None:
        assert redis.proxy.hold() == 1

        async def seen_beyond_replica() -> bool:
            for f in followers:
                ahead[f.task_id] = f.last_id - await redis.last_event_id(replica, keys.events(f.task_id))
            return all(count > 0 for count in ahead.values())

        # kill well within the writers' WAIT timeout, so that they still hold what the replica lacks
        with contextlib.suppress(TimeoutError):
            await wait_for(seen_beyond_replica, timeout=WAIT_TIMEOUT / 3)

    async def failover(_: list[Follower]) -> None:
        await redis.wait_promoted(primary)
        promoted.append(time.monotonic())
        await redis.restart_as_replica(primary)  # the old primary rejoins as a replica of the new one

    outcome = await generate_through(group, primary, lag, failover)
    figures = await check(group, outcome, references)
    print(f"\nprimary killed: {figures}, promotion seen after {promoted[0] - outcome.killed_at:.2f} s; events "
          f"followers had seen but the replica lacked at the kill, per task: {sorted(ahead.values())}")
    assert sum(ahead.values()) > 0  # the failover did lose events that followers had seen
    assert all(f.interruptions for f in outcome.followers)  # every follower lost its stream and came back
    assert await redis.primary() is replica
    await new_requests_succeed(group, group.apis)
    assert all(worker.process is not None and worker.process.poll() is None for worker in group.workers)
