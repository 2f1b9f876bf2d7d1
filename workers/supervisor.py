"""``lmsp worker --gpus all`` (or ``--gpus 0,1``): one worker process per GPU of this host.

Each child is an ordinary ``lmsp worker`` for the same models, so all of them take jobs from the
same queues; its ``CUDA_VISIBLE_DEVICES`` holds its one GPU, which it sees as ``cuda:0`` and
which no other child uses. The supervisor only starts, restarts and stops processes:

- SIGTERM or SIGINT is passed on to every child, which finishes or hands back its tasks
  (``shutdown_grace``); the supervisor exits when all of them have;
- a child that dies is started again after a delay that doubles while it keeps dying (1 s to
  60 s); meanwhile the other workers reclaim its tasks (docs/reliability.md).
"""

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType

logger = logging.getLogger(__name__)

RESTART_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
STABLE_AFTER = 60.0  # a child that ran this long starts again with the shortest delay
POLL = 0.2


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_gpus(value: str, environ: Mapping[str, str]) -> list[str]:
    """The GPUs named by ``--gpus``: ``all`` (those this process may use) or a comma-separated list
    of indexes or UUIDs, as ``CUDA_VISIBLE_DEVICES`` takes them."""
    if value.strip() == "all":
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else \
            [str(i) for i in range(_cuda_device_count())]
        if not gpus:
            raise SystemExit("lmsp worker --gpus all: no CUDA GPU is visible on this host")
        return gpus
    gpus = [v.strip() for v in value.split(",") if v.strip()]
    if not gpus or len(set(gpus)) != len(gpus):
        raise SystemExit(f"lmsp worker --gpus: expected 'all' or distinct GPU ids separated by commas, got {value!r}")
    return gpus


@dataclass
class Child:
    gpu: str
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0
    restart_at: float = 0.0


class Supervisor:
    def __init__(self, gpus: list[str], models: list[str], environ: Mapping[str, str]) -> None:
        self.children = [Child(gpu) for gpu in gpus]
        self.command = [sys.executable, "-m", "lmsp.cli", "worker", *[a for m in models for a in ("--model", m)]]
        self.environ = dict(environ)
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        logger.info("starting one worker per GPU: %s", ", ".join(child.gpu for child in self.children))
        while not self.stopping:
            for child in self.children:
                self._tend(child)
            time.sleep(POLL)
        return self._wait_all()

    def _start(self, child: Child) -> None:
        env = {**self.environ, "CUDA_VISIBLE_DEVICES": child.gpu}
        child.process = subprocess.Popen(self.command, env=env)
        child.started = time.monotonic()
        logger.info("worker for GPU %s started (pid %d)", child.gpu, child.process.pid)

    def _tend(self, child: Child) -> None:
        now = time.monotonic()
        if child.process is None:
            if now >= child.restart_at:
                self._start(child)
            return
        code = child.process.poll()
        if code is None:
            return
        child.failures = 0 if now - child.started >= STABLE_AFTER else child.failures + 1
        delay = RESTART_DELAYS[min(child.failures, len(RESTART_DELAYS) - 1)]
        logger.warning("worker for GPU %s exited with %s; starting it again in %.0f s", child.gpu, code, delay)
        child.process, child.restart_at = None, now + delay

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    def _wait_all(self) -> int:
        for child in self.children:
            if child.process is not None:
                child.process.wait()
        logger.info("all workers stopped")
        return 0


def supervise(gpus_option: str, models: list[str], environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    return Supervisor(parse_gpus(gpus_option, environ), models, environ).run()
