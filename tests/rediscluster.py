"""A Redis Cluster for tests: three primaries or more, each with its replicas, real ``redis-server``
processes on loopback (``lmsp.rediscluster``), with a node timeout short enough that a failover takes a
few seconds. Its methods block: an async test calls the slow ones through ``asyncio.to_thread``."""

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisError

from lmsp.rediscluster import start_cluster

# the services get this URL with the cluster: nothing listens on port 1, so a client that ignored
# the cluster would fail at once instead of reaching one node
UNUSED_URL = "redis://127.0.0.1:1/0"
# a node that does not answer for this long is failing; its replica is promoted about a second later
NODE_TIMEOUT_MS = 2000


class LocalCluster:
    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        self.primaries = primaries
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="lmsp-cluster-"))
        self.nodes: list[str] = []  # 127.0.0.1:PORT, the first primaries first
        self.processes: dict[int, subprocess.Popen[bytes]] = {}  # by port
        self._children: list[subprocess.Popen[bytes]] = []
        self._slots: dict[int, list[tuple[int, int]]] = {}  # a killed primary's slot ranges

    @property
    def ports(self) -> list[int]:
        return [int(node.rpartition(":")[2]) for node in self.nodes]

    @property
    def settings(self) -> dict[str, Any]:
        """The LMSP settings (``redis_*``) of a service that uses this cluster."""
        return {"redis_cluster": ",".join(self.nodes[:self.primaries]), "redis_url": UNUSED_URL}

    def start(self) -> None:
        """Start the cluster; stop() stops what started even when it did not form."""
        self.nodes = start_cluster(self.dir, self.primaries, self.replicas, self._children,
                                   node_timeout_ms=self.node_timeout_ms, appendonly=False)
        by_pid = {child.pid: child for child in self._children}
        for port in self.ports:
            with self.client(port) as client:
                self.processes[port] = by_pid[int(client.info("server")["process_id"])]

    def stop(self) -> None:
        for process in self._children:
            if process.poll() is None:
                process.terminate()
        for process in self._children:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def cleanup(self) -> None:
        """``stop``, under the name ``tests.faults.Group`` uses for every Redis."""
        self.stop()

    def client(self, port: int) -> redis.Redis:
        """A client of the node on ``port`` alone (no redirections followed)."""
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)

    def live(self) -> list[int]:
        """The ports of the nodes whose process runs."""
        return [port for port, process in self.processes.items() if process.poll() is None]

    def slot_map(self, port: int | None = None) -> list[tuple[int, int, int]]:
        """(first slot, last slot, primary's port) of every slot range, as the node on ``port`` (by
        default the first live one) sees them."""
        with self.client(port or self.live()[0]) as client:
            ranges = client.cluster("SLOTS")
        return [(int(first), int(last), int(primary[1])) for first, last, primary, *_ in ranges]

    def primary_of(self, key: str) -> tuple[int, subprocess.Popen[bytes]]:
        """The port and process of the primary that serves ``key`` now."""
        with self.client(self.live()[0]) as client:
            slot = int(client.cluster("KEYSLOT", key))
        port = next(port for first, last, port in self.slot_map() if first <= slot <= last)
        return port, self.processes[port]

    def kill(self, port: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the node on ``port`` and wait until it ends; a primary's slots are noted
        first, for ``wait_promoted``."""
        self._slots[port] = [(first, last) for first, last, owner in self.slot_map(port) if owner == port]
        process = self.processes[port]
        process.send_signal(sig)
        process.wait(timeout=10)

    def wait_promoted(self, port: int, timeout: float = 30) -> int:
        """Wait until every live node says cluster_state:ok and that another node serves the slots
        of the killed primary on ``port``; that node's port."""
        first = self._slots[port][0][0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                owners = {self._owner(node, first) for node in self.live()}
            except (RedisError, OSError):
                owners = set()
            if len(owners) == 1 and None not in owners and port not in owners:
                new = owners.pop()
                assert new is not None
                return new
            time.sleep(0.1)
        raise TimeoutError(f"no node took over the slots of {port}: {self.slot_map()}")

    def _owner(self, node: int, slot: int) -> int | None:
        """The primary that serves ``slot`` as the node on ``node`` sees it; None while that node
        does not find the cluster ok."""
        with self.client(node) as client:
            if client.cluster("INFO")["cluster_state"] != "ok":
                return None
        return next(owner for first, last, owner in self.slot_map(node) if first <= slot <= last)

