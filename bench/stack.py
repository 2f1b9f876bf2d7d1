"""The service under measurement: its own redis-server (or Redis Cluster), one API process and one
worker process, started on free ports and stopped again; and what the benchmark reads about those
processes."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.cluster import RedisCluster

from lmsp.rediscluster import start_cluster
from lmsp_core.ports import free_port
from lmsp_core.store import keys

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def wait_port(port: int, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


class Stack:
    """redis-server + ``lmsp api`` + ``lmsp worker`` for the given model specs (the first is served)."""

    backend = "single"  # what the benchmark calls this kind of Redis

    def __init__(self, models: list[dict[str, Any]], served: list[str], torch_threads: int,
                 extra_env: dict[str, str] | None = None, worker: list[str] | None = None) -> None:
        """``worker``: the worker's command, in place of ``lmsp worker`` for the served models."""
        self.dir = Path(tempfile.mkdtemp(prefix="lmsp-bench-"))
        self.extra_env = extra_env or {}
        self.worker_ready_seconds = 0.0
        self.models_file = self.dir / "models.json"
        self.models_file.write_text(json.dumps(models))
        self.served = served
        self.torch_threads = torch_threads
        self.redis_port, self.api_port = free_port(), free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        models_args = [arg for model in served for arg in ("--model", model)]
        self.worker_command = worker or [sys.executable, "-m", "lmsp.cli", "worker", *models_args]

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def primaries(self) -> list[str]:
        """A URL of each Redis that holds data: the one, or each shard's primary."""
        return [self.redis_url]

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")}
        env.update(LMSP_REDIS_URL=self.redis_url, LMSP_MODELS_FILE=str(self.models_file), LMSP_AUTH="none",
                   LMSP_RATE_LIMIT="0", LMSP_MAX_STREAMS="0", LMSP_MAX_QUEUE_DEPTH="0", LMSP_LOG_LEVEL="WARNING",
                   LMSP_TORCH_THREADS=str(self.torch_threads), PYTHONUNBUFFERED="1")
        return env | self.extra_env | (extra or {})

    def _spawn(self, args: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.dir / log, "wb") as out:
            process = subprocess.Popen(args, env=self._env(env), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.processes.append(process)
        return process

    def _redis_server(self, port: int, name: str, *extra: str) -> subprocess.Popen[bytes]:
        binary = shutil.which("redis-server") or "redis-server"
        process = self._spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(self.dir), "--dbfilename", f"{name}.rdb", *extra], f"{name}.log")
        wait_port(port, process)
        return process

    def __enter__(self) -> "Stack":
        try:
            self._start_redis()
            self.api = self._spawn([sys.executable, "-m", "lmsp.cli", "api", "--port", str(self.api_port)],
                                   "api.log")
            started = time.perf_counter()
            self.worker = self._spawn(self.worker_command, "worker.log")
            wait_port(self.api_port, self.api)
            self._wait_worker()
        except BaseException:
            # a with statement calls __exit__ only once __enter__ returned: stop what started here
            self.__exit__(None, None, None)
            raise
        self.worker_ready_seconds = time.perf_counter() - started
        return self

    def _start_redis(self) -> None:
        self.redis = self._redis_server(self.redis_port, "redis")

    def _registry(self) -> redis.Redis:
        """A plain client of the Redis that holds the worker registry."""
        return redis.Redis.from_url(self.redis_url)

    def _wait_worker(self, timeout: float = 1800, count: int = 1) -> None:
        client = self._registry()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in self.processes):
                    logs = "\n".join(path.read_text()[-2000:] for path in self.dir.rglob("*.log"))
                    raise RuntimeError(f"a process of the stack exited:\n{logs}")
                states = [json.loads(raw).get("state") for key in client.keys(keys.worker("*"))  # type: ignore[union-attr,arg-type]
                          if (raw := client.get(key))]
                if states.count("ready") >= count:
                    return
                time.sleep(0.1)
        finally:
            client.close()
        raise TimeoutError("the worker did not start")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class ReplicatedStack(Stack):
    """A primary with one replica and, for each variant, an API and a worker with the variant's extra
    environment, serving the model under the variant's id (the same weights): requests to a variant's
    id on its API see only its settings. Workers take turns: only one variant is measured at a time."""

    def __init__(self, models: list[dict[str, Any]], variants: dict[str, dict[str, str]], torch_threads: int) -> None:
        super().__init__(models, list(variants), torch_threads)
        self.variants = variants
        self.replica_port = free_port()
        self.api_ports = {name: free_port() for name in variants}

    def __enter__(self) -> "ReplicatedStack":
        self.redis = self._redis_server(self.redis_port, "redis")
        self.replica = self._redis_server(self.replica_port, "replica", "--replicaof", "127.0.0.1",
                                          str(self.redis_port))
        apis = {}
        for name, env in self.variants.items():
            apis[name] = self._spawn([sys.executable, "-m", "lmsp.cli", "api", "--port", str(self.api_ports[name])],
                                     f"api-{name}.log", env)
            self._spawn([sys.executable, "-m", "lmsp.cli", "worker", "--model", name], f"worker-{name}.log", env)
        for name, api in apis.items():
            wait_port(self.api_ports[name], api)
        self._wait_worker(count=len(self.variants))
        return self

    def kill_replica(self) -> None:
        self.replica.kill()
        self.replica.wait()
        self.processes.remove(self.replica)


class ClusterStack(Stack):
    """A Redis Cluster of ``SHARDS`` primaries and no replica, and an API and a worker that use it
    (``LMSP_REDIS_CLUSTER``; their ``LMSP_REDIS_URL`` names a port nothing listens on, so a client
    that ignored the cluster would fail instead of reaching one node)."""

    backend = "cluster"
    SHARDS = 3  # the fewest a Redis Cluster takes (``lmsp.rediscluster``)
    UNUSED_URL = "redis://127.0.0.1:1/0"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nodes: list[str] = []  # 127.0.0.1:PORT of each primary

    @property
    def redis_url(self) -> str:
        return self.UNUSED_URL

    @property
    def primaries(self) -> list[str]:
        return [f"redis://{node}/0" for node in self.nodes]

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return super()._env({"LMSP_REDIS_CLUSTER": ",".join(self.nodes), **(extra or {})})

    def _start_redis(self) -> None:
        # the nodes join self.processes as they start: __exit__ stops them whatever fails here
        self.nodes = start_cluster(self.dir / "cluster", self.SHARDS, 0, self.processes, appendonly=False)

    def _registry(self) -> redis.Redis:
        # every key of the registry has the tag {workers}: one node holds them all, and KEYS there finds them
        with RedisCluster.from_url(self.primaries[0]) as cluster:
            node = cluster.get_node_from_key(keys.workers())
        return redis.Redis(host=node.host, port=node.port)
