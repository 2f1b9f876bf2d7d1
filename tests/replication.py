"""A Redis that fails over, for tests: a primary, one replica and three sentinels, real processes on
loopback, with Sentinel timeouts short enough that a failover takes a few seconds.

The first primary is reached through a proxy (``ReplicationHold``), by everyone: sentinels, replica
and services. The proxy can hold back what the primary sends to its replica, so a test can make the
replica lag at the moment the primary dies, which on loopback it otherwise never does.
"""

import asyncio
import socket
import threading
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tests.proxy import close_all, relay, shut_down
from tests.support import RedisServer, SentinelServer, free_port, wait_for

MASTER = "lmsp-test"
# the services get this URL with the sentinels: nothing listens on port 1, so a connection that
# ignored the sentinels would fail at once instead of working until the first failover
UNUSED_URL = "redis://127.0.0.1:1/0"
# above Sentinel's ping period (1 s): a sentinel that switches to a new primary opens a new link to
# it and pings it only a period later, so at 1000 the three could find the new primary down a second
# after promoting it and fail over again (to the old primary, restarted as a replica
# meanwhile and still empty, where one was there to promote)
DOWN_AFTER_MS = 2000
FAILOVER_TIMEOUT_MS = 3000


class ReplicationHold:
    """A TCP proxy to one Redis. ``hold()`` stops forwarding what that Redis sends on its replication
    links (connections whose client said REPLCONF): the primary runs on, the replica falls behind,
    and what was held is lost if the primary dies. Runs its own event loop in a thread."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="replication-hold")

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def hold(self) -> int:
        """Hold the replication links open now; returns how many there are."""
        return asyncio.run_coroutine_threadsafe(self._hold(), self._loop).result(10)

    async def _hold(self) -> int:
        replication = [link for link in self._links if link.replication]
        for link in replication:
            link.held = True
        return len(replication)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port, family=socket.AF_INET))
        self._ready.set()
        self._loop.run_forever()
        shut_down(self._loop, server)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers = [writer]
        link = _Link()
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            writers.append(upstream_writer)
            self._links.add(link)
            await relay(self._requests(reader, upstream_writer, link), self._answers(upstream_reader, writer, link))
        except OSError:
            pass  # nothing upstream: the client sees its connection closed
        finally:
            self._links.discard(link)
            await close_all(writers)

    @staticmethod
    async def _requests(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: "_Link") -> None:
        while chunk := await reader.read(65536):
            link.replication = link.replication or b"REPLCONF" in chunk.upper()
            writer.write(chunk)
            await writer.drain()

    @staticmethod
    async def _answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: "_Link") -> None:
        while chunk := await reader.read(65536):
            if not link.held:  # held bytes are dropped when the connection ends
                writer.write(chunk)
                await writer.drain()


class _Link:
    def __init__(self) -> None:
        self.replication = False
        self.held = False


class ReplicatedRedis:
    def __init__(self) -> None:
        self.nodes = [RedisServer(), RedisServer()]
        self.proxy = ReplicationHold(self.nodes[0].port)  # how everyone reaches the first primary
        self.sentinels: list[SentinelServer] = []

    @property
    def settings(self) -> dict[str, Any]:
        """The LMSP settings (``redis_*``) of a service that uses this Redis."""
        return {"redis_url": UNUSED_URL, "redis_sentinels": ",".join(s.address for s in self.sentinels),
                "redis_master": MASTER}

    async def start(self) -> None:
        primary, replica = self.nodes
        primary.start()
        self.proxy.start()
        replica.start(replica_of=self.proxy.port)
        await self.wait_synced(replica)
        self.sentinels = [SentinelServer(MASTER, self.proxy.port, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS)
                          for _ in range(3)]
        for sentinel in self.sentinels:
            sentinel.start()
        await self.wait_settled(primary, replica)

    def address(self, node: RedisServer) -> int:
        """The port where the others reach ``node`` as a primary."""
        return self.proxy.port if node is self.nodes[0] else node.port

    def node(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if port in (node.port, self.address(node)))

    def other(self, node: RedisServer) -> RedisServer:
        return next(other for other in self.nodes if other is not node)

    async def primary(self) -> RedisServer:
        """The primary as the sentinels name it now."""
        async with self.sentinels[0].client() as client:
            _, port = await client.sentinel_get_master_addr_by_name(MASTER)
        return self.node(int(port))

    async def last_event_id(self, node: RedisServer, events_key: str) -> int:
        """The number of the last event of a task's stream on ``node`` (0: none)."""
        async with aioredis.Redis(port=node.port) as client:
            last = await client.xrevrange(events_key, count=1)
        return int(last[0][0].split(b"-")[1]) if last else 0

    async def wait_synced(self, replica: RedisServer) -> None:
        async def synced() -> bool:
            async with aioredis.Redis(port=replica.port, decode_responses=True) as client:
                info = await client.info("replication")
            return bool(info["role"] == "slave" and info["master_link_status"] == "up")

        try:
            await wait_for(synced, timeout=30, what=f"replica {replica.port} to sync")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; its log:\n{replica.output()[-3000:]}\n{self.sentinel_logs()}") from None

    async def wait_settled(self, primary: RedisServer, replica: RedisServer) -> None:
        """Every sentinel names ``primary``, knows the two other sentinels, and sees ``replica`` up
        and linked: a failover can then elect a leader and promote the replica."""
        async def settled() -> bool:
            for sentinel in self.sentinels:
                async with sentinel.client() as client:
                    master = await client.sentinel_master(MASTER)
                    replicas = await client.sentinel_slaves(MASTER)
                healthy = [r for r in replicas if int(r["port"]) == replica.port and not r["is_sdown"]
                           and not r["is_disconnected"] and r["master-link-status"] == "ok"]
                if int(master["port"]) != self.address(primary) or master["num-other-sentinels"] != 2 \
                        or not healthy:
                    return False
            return True

        try:
            await wait_for(settled, timeout=60, what="the sentinels to agree on the primary and its replica")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; {self.sentinel_logs()}") from None

    def sentinel_logs(self) -> str:
        """The end of each sentinel's log (what it saw and did), for a failure's message."""
        return "\n".join(f"sentinel {s.port}:\n{s.output()[-1500:]}" for s in self.sentinels)

    async def wait_promoted(self, old: RedisServer) -> RedisServer:
        """Wait until every sentinel has ended a failover to another primary, which says it is one;
        return it. A failover in progress does not count: Sentinel already names the replica it
        promotes, which already says it is a primary, but the failover can still time out and be
        tried again with another replica (on a loaded machine it did: the killed node, restarted as
        a replica meanwhile, empty, was promoted)."""
        async def promoted() -> RedisServer | None:
            ports = set()
            for sentinel in self.sentinels:
                async with sentinel.client() as client:
                    master = await client.sentinel_master(MASTER)
                if "failover_in_progress" in master["flags"].split(","):
                    return None
                ports.add(int(master["port"]))
            if len(ports) != 1 or self.node(ports.copy().pop()) is old:
                return None
            new = self.node(ports.pop())
            try:
                async with aioredis.Redis(port=new.port, decode_responses=True) as client:
                    role = (await client.execute_command("ROLE"))[0]
            except (RedisError, OSError):
                return None
            return new if role == "master" else None

        try:
            new: RedisServer = await wait_for(promoted, timeout=60, what="a replica to be promoted")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; {self.sentinel_logs()}") from None
        return new

    async def restart_as_replica(self, node: RedisServer) -> None:
        """Start a killed node again as a replica of the current primary (what an operator, or a
        restart policy that asks the sentinels, does), and wait until all agree on it."""
        primary = await self.primary()
        node.start(replica_of=self.address(primary))
        await self.wait_synced(node)
        await self.wait_settled(primary, node)

    def cleanup(self) -> None:
        for sentinel in self.sentinels:  # first: no failover while the nodes stop
            sentinel.cleanup()
        self.proxy.stop()
        for node in self.nodes:
            node.cleanup()
