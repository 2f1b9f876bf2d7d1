"""Our own processes (``lmsp api``, ``lmsp worker``) on free ports, their logs kept in files, and the
environment they run with."""

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from lmsp_core.ports import free_port
from lmsp_core.settings import load_settings
from lmsp_core.store import connections, registry
from tests.support.waiting import wait_port

ROOT = Path(__file__).resolve().parents[2]
SECURE_CORS_ORIGIN = "https://app.example"  # the one origin the secure_api fixture allows


class Service:
    """A process of ours (`lmsp api` or `lmsp worker`), its log kept in a file."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.args = args
        self.env = env
        self.log = Path(tempfile.mkstemp(prefix=f"lmsp-{name}-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "Service":
        """Start the process without waiting for it to serve (``Api.start`` waits; see ``ready``)."""
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "lmsp.cli", *self.args], env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        return self

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM) without waiting for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def service_env(redis_url: str, **settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")}
    env["LMSP_REDIS_URL"] = redis_url
    env["PYTHONUNBUFFERED"] = "1"
    env["LMSP_TORCH_THREADS"] = "1"  # several workers share 2 cores
    for name, value in settings.items():
        if value is not None:  # None: the setting's own default
            env[f"LMSP_{name.upper()}"] = str(value)
    return env


class Api(Service):
    """An API process; without settings saying otherwise it runs open on loopback (``LMSP_AUTH=none``)
    and without rate or stream limits, as the tests of everything but security expect."""

    def __init__(self, redis_url: str, **settings: Any) -> None:
        settings = {"auth": "none", "rate_limit": 0, "max_streams": 0, **settings}
        self.port = free_port()
        super().__init__(["api", "--port", str(self.port)], service_env(redis_url, **settings), "api")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Api":
        super().start()
        wait_port(self.port)
        return self

    async def ready(self, timeout: float = 120) -> "Api":
        """Wait until the process (started with ``Service.start``) listens on its port."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"api exited:\n{self.output()[-3000:]}")
            if await _listens(self.port):
                return self
            await asyncio.sleep(0.05)
        raise TimeoutError(f"api not listening:\n{self.output()[-3000:]}")


async def _listens(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


class Worker(Service):
    def __init__(self, redis_url: str, models: list[str], **settings: Any) -> None:
        args = ["worker", *[arg for model in models for arg in ("--model", model)]]
        super().__init__(args, service_env(redis_url, **settings), "worker")
        self.redis_url = redis_url
        self.models = models

    async def ready(self, timeout: float = 120) -> "Worker":
        """Wait until this process heartbeats in Redis as ready (warmed up; the Redis its settings name: a
        URL, or sentinels)."""
        assert self.process is not None
        client = connections.connect(load_settings(self.env))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"worker exited:\n{self.output()[-3000:]}")
                for info in await registry.live_workers(client):
                    if info.pid == self.process.pid and info.state == "ready":
                        return self
                await asyncio.sleep(0.1)
        finally:
            await connections.close(client)
        raise TimeoutError(f"worker not ready:\n{self.output()[-3000:]}")


async def start_all(*services: Api | Worker, timeout: float = 120) -> None:
    """Start the processes at once and wait until each is ready: a start is mostly its imports (torch
    for a worker), so starts side by side overlap on the cores instead of queueing."""
    for service in services:
        Service.start(service)
    await ready_all(*services, timeout=timeout)


async def ready_all(*services: Api | Worker, timeout: float = 120) -> None:
    """Wait until each started process is ready; the first that fails ends the others' waits."""
    waits = [asyncio.ensure_future(service.ready(timeout)) for service in services]
    try:
        await asyncio.gather(*waits)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


def stop_all(*services: Service) -> None:
    """Ask every process to stop at once, then wait for each."""
    for service in services:
        service.terminate()
    for service in services:
        service.stop()


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    """The worker started and ready; stopped on the way out."""
    async with all_running(worker):
        yield worker


@contextlib.asynccontextmanager
async def all_running(*services: Api | Worker) -> AsyncIterator[None]:
    """The processes started side by side and ready; all stopped on the way out."""
    try:
        await start_all(*services)
        yield
    finally:
        stop_all(*services)
