"""Redis Cluster (``LMSP_REDIS_CLUSTER``): the client every process uses on a cluster.

redis-py's cluster client routes each command by the slot of its keys, follows MOVED answers and
re-reads the slot map after a failover. What it does not do (redis-py 5, which arq pins) is what
one Redis connection does: transactions (MULTI, WATCH), pub/sub, and a connection that a library
such as arq keeps for its whole life. Each of those touches keys of one slot only (the key names
are made so: ``keys``), so ``ClusterClient`` gives them a plain connection to the primary of that
slot:

- ``pinned(key)``: a client whose connections go to the primary that serves ``key``'s slot now,
  asking the cluster again on every reconnection. A redirection (the slot moved, the node was
  demoted) drops the connection and fails the command as a ConnectionError, which every caller
  already treats as a short Redis outage (docs/reliability.md), as with Sentinel. arq (each
  model's queue) and the subscriptions use these.
- ``pipeline(transaction=True)``: a MULTI/EXEC (with WATCH) on the node that serves the slot of
  its first key, through a client per node, with the same redirection rule.
- a pipeline without a transaction is redis-py's, which sends each node its commands; scripts
  in it that a node does not know yet (a promoted replica) are loaded and sent again.

After a connection error redis-py re-reads the slot map; here that no longer closes the
connections of every other node on the way (``ClusterClient.aclose``, ``KeepingNodesManager``), nor
fails while the first primary is down (``ClusterClient.initialize``).
"""

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any, cast

from arq.connections import ArqRedis
from redis._parsers.helpers import _RedisCallbacks, _RedisCallbacksRESP2
from redis.asyncio import ConnectionPool
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, NodesManager, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.client import CaseInsensitiveDict
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError, NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.typing import EncodableT, KeyT

logger = logging.getLogger(__name__)

# answers that mean "this node no longer serves the slot": reconnect to the one that does
_REDIRECTIONS = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN", "READONLY")
MIN_MAJOR = 7  # SSUBSCRIBE / SPUBLISH
# how often a connection that keeps failing re-reads the slot map from the cluster, at most
REFRESH_INTERVAL = 0.5


class SlotConnection(Connection):
    """A connection to the primary of one slot (or to one node), that gives up on redirections."""

    def __init__(self, *, cluster: "ClusterClient", slot: int | None, **options: Any) -> None:
        self.cluster = cluster
        self.slot = slot
        super().__init__(**options)

    async def connect(self) -> None:
        if self.slot is not None and not self.is_connected:
            self.host, self.port = await self.cluster.locate(self.slot)
        try:
            await super().connect()  # type: ignore[no-untyped-call]
        except (ConnectionError, OSError):
            self.cluster.stale = True
            raise

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not str(exc).startswith(_REDIRECTIONS):
                raise
            self.cluster.stale = True
            await self.disconnect()
            raise ConnectionError(f"{self.host}:{self.port} no longer serves this slot ({exc})") from exc


class SlotSSLConnection(SlotConnection, SSLConnection):
    """``SlotConnection`` over TLS (a ``rediss://`` LMSP_REDIS_URL)."""


class KeepingNodesManager(NodesManager):
    """redis-py's slot map, which on every re-read replaces each node by a new one and closes the
    old one's connections, those in use included (a blocking read on a healthy shard then fails):
    this one keeps a node whose address it knows, with its connections."""

    __slots__ = ()

    def set_nodes(self, old: dict[str, ClusterNode], new: dict[str, ClusterNode], remove_old: bool = False) -> None:
        if old is self.nodes_cache:  # a re-read: the slot map was just built with new nodes
            for name, node in list(new.items()):
                kept = old.get(name)
                if kept is not None and kept is not node:
                    kept.server_type = node.server_type
                    new[name] = kept
            for nodes in self.slots_cache.values():
                nodes[:] = [new.get(node.name, node) for node in nodes]
        super().set_nodes(old, new, remove_old)


class ClusterClient(RedisCluster):
    """redis-py's cluster client with the single-slot connections described above."""

    def __init__(self, nodes: list[tuple[str, int]], options: dict[str, Any]) -> None:
        super().__init__(startup_nodes=[ClusterNode(host, port) for host, port in nodes], **options)
        self.nodes_manager.__class__ = KeepingNodesManager
        self._options = {name: value for name, value in options.items() if name not in _CLUSTER_ONLY}
        self._connection_class = SlotSSLConnection if self._options.pop("ssl", False) else SlotConnection
        self._pinned: dict[int, ArqRedis] = {}
        self._nodes: dict[str, ArqRedis] = {}
        self._scripts: dict[str, bytes | str] = {}
        self._refreshed = -REFRESH_INTERVAL
        self._refresh_lock = asyncio.Lock()
        self.stale = False

    # --- clients of one slot or one node ---------------------------------------------------------

    def pinned(self, key: KeyT) -> ArqRedis:
        """A client of the primary that serves ``key``'s slot, whichever node that is when it
        connects: for everything that keeps a connection (arq, subscriptions)."""
        slot = self.keyslot(key)
        client = self._pinned.get(slot)
        if client is None:
            client = self._pinned[slot] = self._client(slot=slot)
        return client

    def _client(self, **where: Any) -> ArqRedis:
        pool = ConnectionPool(connection_class=self._connection_class, cluster=self, **self._options, **where)
        return cast(ArqRedis, ArqRedis.from_pool(pool))

    async def node_client(self, key: KeyT) -> ArqRedis:
        """A client of the node that serves ``key``'s slot now (for a transaction)."""
        host, port = await self.locate(self.keyslot(key))
        name = f"{host}:{port}"
        client = self._nodes.get(name)
        if client is None:
            client = self._nodes[name] = self._client(slot=None, host=host, port=port)
        return client

    async def locate(self, slot: int) -> tuple[str, int]:
        """The address of the primary serving ``slot``, re-reading the slot map first when a
        connection failed or was redirected since it was last read."""
        now = asyncio.get_running_loop().time()
        if self.stale and now - self._refreshed >= REFRESH_INTERVAL:
            self._refreshed, self.stale, self._initialize = now, False, True
        await self.initialize()
        node = self.nodes_manager.get_node_from_slot(slot)
        return node.host, int(node.port)

    async def shards_of(self, keys: Iterable[KeyT]) -> dict[str, tuple[ClusterNode, int]]:
        """The primaries that serve these keys now, by name, each with how many replicas the slot
        map lists for it (those not marked as failed); keys of a slot that no node serves now are
        left out (their commands fail anyway)."""
        if self._initialize:
            await self.initialize()
        shards = {}
        for key in keys:
            nodes = self.nodes_manager.slots_cache.get(self.keyslot(key))
            if nodes:
                shards[nodes[0].name] = (nodes[0], len(nodes) - 1)
        return shards

    # --- transactions, pipelines, scripts --------------------------------------------------------

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if transaction:
            return SlotTransaction(self)
        return ScriptingPipeline(self)  # type: ignore[abstract]

    def register_script(self, script: bytes | str) -> AsyncScript:  # type: ignore[override]
        registered: AsyncScript = super().register_script(script)  # type: ignore[misc]
        self._scripts[registered.sha] = script
        return registered

    async def load_scripts(self) -> None:
        """Load every registered script on every primary (a promoted replica knows none)."""
        for script in list(self._scripts.values()):
            await self.script_load(script)

    async def check_version(self) -> None:
        """Refuse a cluster whose primaries run a Redis before 7: sharded pub/sub (the wake
        channels) needs 7. Raises RuntimeError saying which nodes."""
        answers = await self.info("server", target_nodes=RedisCluster.PRIMARIES)
        old = {name: info["redis_version"] for name, info in answers.items()
               if int(str(info["redis_version"]).split(".")[0]) < MIN_MAJOR}
        if old:
            raise RuntimeError(f"Redis Cluster nodes {old} run a Redis before {MIN_MAJOR}, which lacks sharded pub/sub")

    async def initialize(self) -> "ClusterClient":
        """Read the slot map (when asked to). redis-py's own version also asks the first primary for
        its command table each time, and while that primary is down (until its replica is
        promoted) fails, closing every connection: every command would fail, on every shard. The
        table is read once, from any node that answers. No node answering is a ConnectionError, as
        for one Redis (redis-py's own exception there is no RedisError: callers would take it for
        a bug, the API answering 500 and the worker's loops ending)."""
        if not self._initialize:
            return self
        async with self._refresh_lock:
            if self._initialize:
                try:
                    await self.nodes_manager.initialize()
                except RedisClusterException as exc:
                    raise ConnectionError(f"no node of the Redis Cluster answers ({exc})") from exc
                if not self.commands_parser.commands:
                    await self._read_command_table()
                self._initialize = False
        return self

    async def _determine_slot(self, command: str, *args: Any) -> int:
        # redis-py asks a node (``COMMAND GETKEYS``, a round trip, to the node it first asked for
        # its command table, dead or not) where the keys of a stream read are: they follow STREAMS
        if command.upper() in ("XREAD", "XREADGROUP"):
            words = [arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg) for arg in args]
            after = [word.upper() for word in words].index("STREAMS") + 1
            names = args[after:after + (len(args) - after) // 2]
            slots = {self.keyslot(name) for name in names}
            if len(slots) == 1:
                return slots.pop()
        slot: int = await super()._determine_slot(command, *args)
        return slot

    async def _read_command_table(self) -> None:
        for node in self.nodes_manager.nodes_cache.values():
            with contextlib.suppress(RedisError, OSError):
                await self.commands_parser.initialize(node)
                return
        raise ConnectionError("no node of the Redis Cluster answers")

    async def aclose(self) -> None:
        """Only ask for the slot map to be read again (``aclose_all`` closes). redis-py calls this
        after a connection error or timeout of any command or pipeline; its own version closes
        every node's connections, those that other commands use on healthy shards at that moment
        included (they fail too, or find no node at all: redis/redis-py#3835)."""
        self._initialize = True

    async def aclose_all(self) -> None:
        """Close this client and every single-slot client made from it."""
        for client in [*self._pinned.values(), *self._nodes.values()]:
            with contextlib.suppress(Exception):
                await client.aclose()
        self._pinned.clear()
        self._nodes.clear()
        self._initialize = True
        await self.nodes_manager.aclose()
        await self.nodes_manager.aclose("startup_nodes")


# options of redis-py's cluster client that a plain connection does not take
_CLUSTER_ONLY = {"require_full_coverage", "cluster_error_retry_attempts", "reinitialize_steps",
                 "read_from_replicas", "address_remap", "connection_error_retry_attempts", "max_connections"}


class SlotTransaction(Pipeline):
    """MULTI/EXEC (and WATCH) on the node that serves the slot of the first key it meets."""

    def __init__(self, cluster: ClusterClient) -> None:
        self.owner = cluster
        super().__init__(connection_pool=cast(ConnectionPool, None), response_callbacks=_PLAIN_CALLBACKS,
                         transaction=True, shard_hint=None)

    async def _bind(self, key: KeyT) -> None:
        if self.connection_pool is None:
            self.connection_pool = (await self.owner.node_client(key)).connection_pool

    async def watch(self, *names: KeyT) -> None:  # type: ignore[override]
        await self._bind(names[0])
        await super().watch(*names)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        if self.command_stack and self.connection_pool is None:
            await self._bind(self.command_stack[0][0][1])
        return await super().execute(raise_on_error)

    async def reset(self) -> None:
        if self.connection_pool is not None:
            await super().reset()  # type: ignore[no-untyped-call]
        else:  # nothing was sent
            self.command_stack = []
            self.watching = self.explicit_transaction = False


class ScriptingPipeline(ClusterPipeline):
    """redis-py's cluster pipeline; EVALSHAs answered NOSCRIPT are sent again after loading the
    registered scripts on every primary (redis-py does this for one Redis, not for a cluster)."""

    def __init__(self, cluster: ClusterClient) -> None:
        super().__init__(cluster)
        self.owner = cluster

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        stack = [(command.args, command.kwargs) for command in self._command_stack]
        results: list[Any] = await super().execute(False, allow_redirections)
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:
            await self.owner.load_scripts()
            for i in missing:
                args, kwargs = stack[i]
                super().execute_command(*args, **kwargs)
            for i, result in zip(missing, await super().execute(False, allow_redirections), strict=True):
                results[i] = result
        failed = next((result for result in results if isinstance(result, Exception)), None)
        if raise_on_error and failed is not None:
            raise failed
        return results


def evalsha(pipe: Any, script: AsyncScript, keys: list[str], args: list[EncodableT]) -> None:
    """Queue a script call in a pipeline, a cluster's or one Redis's: redis-py's ``Script`` cannot be
    called with a cluster pipeline (awaiting it empties the pipeline)."""
    if isinstance(pipe, ClusterPipeline):
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    else:
        pipe.scripts.add(script)  # loaded before the pipeline runs, where Redis lacks it
        pipe.evalsha(script.sha, len(keys), *keys, *args)


# the answer parsers of a plain RESP2 client, as redis.asyncio.Redis sets them up
_PLAIN_CALLBACKS = CaseInsensitiveDict({**_RedisCallbacks, **_RedisCallbacksRESP2})
