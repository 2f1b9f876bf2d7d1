"""redis-server processes of the tests' own, on free ports: a plain Redis (which a test may stop and
start again) and Sentinel. A Redis Cluster is ``tests/rediscluster.py``."""

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from lmsp_core.ports import free_port
from tests.support.waiting import wait_port


def redis_binary() -> str:
    return shutil.which("redis-server") or "redis-server"


class RedisServer:
    """A redis-server of the test's own, which a test may stop and start again (as the replica of
    the Redis on port ``replica_of``)."""

    def __init__(self, appendonly: bool = False) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="lmsp-redis-"))
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def settings(self) -> dict[str, Any]:
        """The LMSP settings (``redis_*``) of a service that uses this Redis."""
        return {"redis_url": self.url}

    @property
    def log(self) -> Path:
        return self.dir / "redis.log"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def start(self, replica_of: int | None = None) -> None:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--logfile", str(self.log)]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
            self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self) -> aioredis.Redis:
        return aioredis.Redis.from_url(self.url)


class SentinelServer:
    """``redis-server --sentinel`` watching the primary ``master`` (its config file, which Sentinel
    rewrites, in a directory of its own). Short timeouts, so that a failover takes seconds."""

    def __init__(self, master: str, primary_port: int, down_after_ms: int = 2000,
                 failover_timeout_ms: int = 3000) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="lmsp-sentinel-"))
        self.config = self.dir / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {master} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {master} {down_after_ms}\n"
            f"sentinel failover-timeout {master} {failover_timeout_ms}\n")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen([redis_binary(), str(self.config), "--sentinel", "--logfile",
                                         str(self.dir / "sentinel.log")], stdout=subprocess.DEVNULL)
        wait_port(self.port)

    def cleanup(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.port, decode_responses=True)

    def output(self) -> str:
        log = self.dir / "sentinel.log"
        return log.read_text(errors="replace") if log.exists() else ""
