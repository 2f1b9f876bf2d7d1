"""The Redis settings and the one connection factory (``lmsp_core.store.connections``); the factory's
Sentinel side against real sentinels is in test_failover.py."""

import time

import msgspec
import pytest
from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import ConnectionError as RedisConnectionError

from lmsp_core.settings import Settings, load_settings
from lmsp_core.store import connections, keys
from tests.support import RedisServer, free_port


def test_sentinel_settings() -> None:
    settings = load_settings({"LMSP_REDIS_SENTINELS": " 10.0.0.1:26379, [::1]:26380,sentinel-3:1 ",
                              "LMSP_REDIS_MASTER": "lmsp"})
    assert settings.sentinel_addresses == [("10.0.0.1", 26379), ("::1", 26380), ("sentinel-3", 1)]
    assert settings.wait_replicas == 1  # with sentinels, events wait for a replica by default
    assert settings.redis_env() == {"LMSP_REDIS_URL": Settings().redis_url,
                                    "LMSP_REDIS_SENTINELS": settings.redis_sentinels, "LMSP_REDIS_MASTER": "lmsp",
                                    "LMSP_REDIS_CLUSTER": ""}
    assert load_settings({}).wait_replicas == 0 and load_settings({}).sentinel_addresses == []
    assert load_settings({"LMSP_REDIS_WAIT_REPLICAS": "0", "LMSP_REDIS_SENTINELS": "h:1"}).wait_replicas == 0
    assert load_settings({"LMSP_REDIS_WAIT_REPLICAS": "2"}).wait_replicas == 2


def test_cluster_settings() -> None:
    settings = load_settings({"LMSP_REDIS_CLUSTER": "10.0.0.1:7000,node-2:7001"})
    assert settings.cluster_addresses == [("10.0.0.1", 7000), ("node-2", 7001)]
    assert settings.wait_replicas == 1  # with a cluster, events wait for their shard's replica by default
    assert settings.redis_env()["LMSP_REDIS_CLUSTER"] == "10.0.0.1:7000,node-2:7001"
    for wrong, said in ([{"LMSP_REDIS_CLUSTER": "h:1", "LMSP_REDIS_SENTINELS": "s:2"}, "exclude each other"],
                        [{"LMSP_REDIS_CLUSTER": "h:1", "LMSP_REDIS_URL": "redis://h:1/2"}, "database 0 only"],
                        [{"LMSP_REDIS_CLUSTER": "h"}, "not host:port"]):
        with pytest.raises(msgspec.ValidationError, match=said):
            load_settings(wrong)
    for bad in ("sentinel", "h:", ":26379", "h:0", "h:65536", "h:port"):
        with pytest.raises(msgspec.ValidationError, match="not host:port"):
            load_settings({"LMSP_REDIS_SENTINELS": bad})


async def test_a_plain_url_names_the_redis_and_closing_closes_its_connections(redis_server: RedisServer) -> None:
    client = connections.connect(Settings(redis_url=redis_server.url))
    assert await client.ping()
    pool = client.connection_pool
    await client.aclose()
    assert not any(c.is_connected for c in pool._available_connections)


async def test_writes_wait_only_for_replicas_that_are_online(redis_server: RedisServer) -> None:
    """This Redis has no replica: nothing to wait for, so no WAIT that would wait out its timeout."""
    client = connections.connect(Settings(redis_url=redis_server.url))
    try:
        none_wanted = connections.ReplicaWatch(Settings())
        assert await none_wanted.command(client) is None
        assert await connections.replicated(client, none_wanted, keys.task("t"))
        watch = connections.ReplicaWatch(Settings(redis_wait_replicas=1, redis_wait_timeout=30))
        start = time.monotonic()
        assert await watch.command(client) is None and watch.online == 0
        # not confirmed: the primary alone holds it
        assert not await connections.replicated(client, watch, keys.task("t"))
        assert time.monotonic() - start < 5
    finally:
        await client.aclose()
    assert watch.confirmed(1) and not watch.confirmed(0) and not watch.confirmed(None)
    # WAIT 1 0 would block for ever
    assert connections.ReplicaWatch(Settings(redis_wait_replicas=1, redis_wait_timeout=0.0001)).timeout_ms == 1


def test_with_sentinels_the_url_gives_database_credentials_and_tls() -> None:
    options = connections._primary_options("rediss://user:secret@ignored.example:6390/3")
    assert options["db"] == 3 and options["username"] == "user" and options["password"] == "secret"
    assert options["ssl"] is True and "host" not in options and "port" not in options
    assert "ssl" not in connections._primary_options("redis://ignored:1/0")
    with pytest.raises(ValueError, match="unix socket"):
        connections.connect(Settings(redis_url="unix:///run/redis.sock", redis_sentinels="127.0.0.1:26379"))


async def test_sentinels_that_cannot_be_reached_are_an_outage() -> None:
    """A RedisError (ConnectionError), which every caller already retries or answers with 503."""
    client = connections.connect(Settings(redis_sentinels=f"127.0.0.1:{free_port()}", redis_master="lmsp"))
    try:
        with pytest.raises(RedisConnectionError) as caught:
            await client.ping()
        assert isinstance(caught.value, MasterNotFoundError)
    finally:
        await client.aclose()
