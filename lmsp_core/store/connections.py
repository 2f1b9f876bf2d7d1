"""Connections to Redis: the one factory that the API, the workers (arq's polling included), the
reaper and ``lmsp token`` use; and the acknowledgement of writes by replicas.

Without sentinels ``LMSP_REDIS_URL`` names the Redis, as it always did. With
``LMSP_REDIS_SENTINELS`` a client finds the primary by asking the sentinels whenever one of its
connections (re)connects, so a process follows a promotion without a restart: a connection to a
dead primary fails and is dropped, and the next command asks the sentinels again; a connection
still open to a demoted primary gets READONLY, which redis-py's Sentinel connection turns into a
ConnectionError after dropping it. While the sentinels have not promoted a replica yet they name
no primary (``MasterNotFoundError``, a ConnectionError too). Every caller already treats these
RedisErrors as an outage and retries on its own pace (docs/reliability.md), so a failover looks
like a short Redis outage.

An acknowledged write (a worker's events, a created or cancelled task) is followed by ``WAIT``: the
caller goes on once ``redis_wait_replicas`` replicas hold it, or after ``redis_wait_timeout`` (or at
once, while the primary has no replica online) with the primary alone (docs/reliability.md,
"Replication and failover").
"""

import contextlib
import socket
import time
from typing import Any, cast

from arq.connections import ArqRedis
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import RedisError

from lmsp_core.settings import Settings
from lmsp_core.store import cluster, keys

# a sentinel that does not answer within this is skipped (the next one is asked)
SENTINEL_TIMEOUT = 1.0
# connecting to Redis (the primary the sentinels named): a host that is gone fails instead of hanging
CONNECT_TIMEOUT = 2.0
# an open connection to a host that vanished without closing it (no RST: power loss, a partition)
# is dropped after about 5 + 3 x 2 s without an answer to TCP keep-alive probes
KEEPALIVE_OPTIONS = {getattr(socket, name): value for name, value in
                     (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)) if hasattr(socket, name)}


class PrimaryPool(SentinelConnectionPool):
    """The connections to the primary of a Sentinel-watched Redis; closing the pool also closes the
    connections to the sentinels, which redis-py leaves open."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # closing; a new primary only drops the idle connections
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


def connect(settings: Settings, **options: Any) -> ArqRedis:
    """A client of the current primary; it connects at its first command, so a process starts (and
    answers 503) while Redis is away. ``options`` go to every connection (``health_check_interval``)."""
    if settings.cluster_addresses:
        client = cluster.ClusterClient(settings.cluster_addresses, _cluster_options(settings, options))  # type: ignore[abstract]
        return cast(ArqRedis, client)
    sentinels = settings.sentinel_addresses
    if not sentinels:
        # (what the URL's query says wins over these options)
        pool = ConnectionPool.from_url(settings.redis_url, **{"socket_connect_timeout": CONNECT_TIMEOUT, **options})
        return cast(ArqRedis, ArqRedis.from_pool(pool))
    manager = Sentinel(  # type: ignore[no-untyped-call]
        sentinels, sentinel_kwargs={"socket_timeout": SENTINEL_TIMEOUT, "socket_connect_timeout": SENTINEL_TIMEOUT},
        **_primary_options(settings.redis_url), **options)
    client = manager.master_for(settings.redis_master, redis_class=ArqRedis,
                                connection_pool_class=PrimaryPool)
    return cast(ArqRedis, client)


def _cluster_options(settings: Settings, options: dict[str, Any]) -> dict[str, Any]:
    """The nodes' connection options: what the URL says (credentials, TLS) and ``options``."""
    url = _primary_options(settings.redis_url, "LMSP_REDIS_CLUSTER")
    url.pop("db", None)  # a cluster has database 0 only (Settings refuses another)
    # a shard without a primary (failing over, or lost) must not stop the client for the others
    return {**url, **options, "socket_keepalive": True, "socket_keepalive_options": KEEPALIVE_OPTIONS,
            "require_full_coverage": False}


def is_cluster(redis: Redis) -> bool:
    return isinstance(redis, cluster.ClusterClient)


async def close(redis: Redis) -> None:
    """Close a client from ``connect``, and on a cluster the single-slot clients made from it."""
    if isinstance(redis, cluster.ClusterClient):
        await redis.aclose_all()
    else:
        await redis.aclose()


def _primary_options(url: str, setting: str = "LMSP_REDIS_SENTINELS") -> dict[str, Any]:
    """What ``LMSP_REDIS_URL`` still says when the sentinels name the host: database, credentials, TLS."""
    options: dict[str, Any] = dict(parse_url(url))
    if "path" in options:
        raise ValueError(f"{setting} needs a redis:// or rediss:// LMSP_REDIS_URL, not a unix socket")
    for name in ("host", "port"):
        options.pop(name, None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    options.update(socket_connect_timeout=CONNECT_TIMEOUT, socket_keepalive=True,
                   socket_keepalive_options=KEEPALIVE_OPTIONS)
    return options


class ReplicaWatch:
    """What ``WAIT`` to send after an acknowledged write: for ``redis_wait_replicas`` replicas, but no
    more than the primary has online (looked up at most once per ``REFRESH`` seconds). While none
    is online (the replica is down or resynchronising, a promoted replica has none yet) there is
    nothing to wait for, and writes are acknowledged on the primary alone without waiting out the
    timeout each time; the timeout covers an online replica that does not answer."""

    REFRESH = 1.0

    def __init__(self, settings: Settings) -> None:
        self.wanted = settings.wait_replicas
        self.timeout_ms = max(1, round(settings.redis_wait_timeout * 1000))  # WAIT n 0 would block for ever
        self.online: int | None = None  # None: not looked up yet
        self._checked = -self.REFRESH

    async def command(self, redis: Redis) -> tuple[str, int, int] | None:
        """``WAIT n timeout``, or None when there is no replica to wait for."""
        if not self.wanted:
            return None
        if time.monotonic() - self._checked >= self.REFRESH:
            # on failure keep what we knew and ask again next time: the write fails as well, and the
            # next Redis that answers may be another one (a promoted replica, with no replica yet)
            with contextlib.suppress(RedisError, OSError):
                self.online = _online_replicas(await redis.info("replication"))
                self._checked = time.monotonic()
        return self.for_online(self.wanted if self.online is None else self.online)

    def for_online(self, online: int) -> tuple[str, int, int] | None:
        """``WAIT`` for a primary with ``online`` replicas (on a cluster: each shard's, from the
        slot map, which lists the replicas that are not marked as failed)."""
        replicas = min(self.wanted, online)
        return ("WAIT", replicas, self.timeout_ms) if replicas else None

    async def cluster_waits(self, redis: "cluster.ClusterClient",
                            task_keys: list[str]) -> list[tuple[tuple[Any, ...], Any]]:
        """A WAIT for each primary that serves one of ``task_keys``, each with its node, to add to
        a cluster pipeline after the writes: the pipeline sends a node its commands in order on one
        connection, so each WAIT covers the writes sent to its shard (docs/reliability.md)."""
        if not self.wanted:
            return []
        waits = []
        for node, replicas in (await redis.shards_of(task_keys)).values():
            wait = self.for_online(replicas)
            if wait is not None:
                waits.append((wait, node))
        return waits

    def confirmed(self, answer: object) -> bool:
        """Whether a WAIT answer (or None: no WAIT sent) means the wanted replicas hold the writes."""
        return isinstance(answer, int) and answer >= self.wanted


def _online_replicas(info: dict[str, Any]) -> int:
    # INFO replication lists each replica as slaveN: {ip, port, state, offset, lag}
    return sum(1 for name, value in info.items()
               if name.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")


async def replicated(redis: Redis, watch: ReplicaWatch, key: str) -> bool:
    """Wait until the replicas hold every write made before this call, by any connection (at most
    the WAIT timeout), on the Redis, or the cluster shard, that holds ``key``. False: they did not
    confirm (the primary alone holds them)."""
    if isinstance(redis, cluster.ClusterClient):
        return await _replicated_shard(redis, watch, key)
    wait = await watch.command(redis)
    if wait is None:
        return not watch.wanted
    async with redis.pipeline(transaction=False) as pipe:
        # WAIT waits for the replication offset of its own connection's last write: a write on this
        # connection (a PUBLISH, which replicas receive) moves it past every write made before it
        pipe.publish(keys.replication_mark(key), b"")
        pipe.execute_command(*wait)
        _, acknowledged = await pipe.execute()
    return watch.confirmed(acknowledged)


async def _replicated_shard(redis: "cluster.ClusterClient", watch: ReplicaWatch, key: str) -> bool:
    waits = await watch.cluster_waits(redis, [key])
    if not waits:
        return not watch.wanted
    (wait, node), = waits
    async with redis.pipeline(transaction=False) as pipe:
        # a sharded message on a channel of the key's slot: a write on the connection to its primary
        pipe.execute_command("SPUBLISH", keys.replication_mark(key), b"")
        pipe.execute_command(*wait, target_nodes=node)
        _, acknowledged = await pipe.execute()
    return watch.confirmed(acknowledged)
