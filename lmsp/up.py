"""``lmsp up``: the whole service in the foreground, for local use.

Starts a local ``redis-server`` (append-only file in the data directory, on a free port) unless a
Redis URL, sentinels or a Redis Cluster are given, one worker process for the requested models, and
the API in this process. Stopping it, with Ctrl-C (SIGINT) or SIGTERM (``kill``, systemd, ``docker
stop``), stops the rest: the worker first (it hands its running tasks back), then Redis.

``--local-cluster N`` starts a local Redis Cluster instead (``lmsp.rediscluster``): N primaries (3 or
more) with one replica each, every node a ``redis-server`` on free loopback ports, with its data in
the data directory. A cluster's configuration names its nodes' ports, which change from one start to
the next: every start forms a new, empty cluster.

Authentication: on a loopback address (the default, 127.0.0.1) ``lmsp up`` runs with
``LMSP_AUTH=none``; on any other address it keeps bearer tokens. An explicit ``LMSP_AUTH`` wins
(and ``none`` off loopback is still refused by the API).
"""

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from lmsp import rediscluster
from lmsp_core import logs
from lmsp_core.ports import free_port
from lmsp_core.settings import Settings

logger = logging.getLogger(__name__)


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "lmsp"


def start_redis(directory: Path, children: list[subprocess.Popen[bytes]]) -> str:
    """A redis-server on a free port, appended to ``children`` as soon as it runs; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed; run scripts/bootstrap or pass --redis-url")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--appendonly", "yes",
         "--save", "", "--daemonize", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL,
    )
    children.append(process)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")  # the caller stops it


def auth_for_up(settings: Settings, environ: Mapping[str, str]) -> Settings:
    if "LMSP_AUTH" in environ:
        return settings
    return settings.replace(auth="none" if settings.host_is_loopback else "tokens")


def needs_local_redis(settings: Settings, environ: Mapping[str, str]) -> bool:
    """No Redis URL, sentinels or Redis Cluster was given."""
    return ("LMSP_REDIS_URL" not in environ and settings.redis_url == Settings().redis_url
            and not settings.sentinel_addresses and not settings.cluster_addresses)


def check_local_cluster(settings: Settings, environ: Mapping[str, str], primaries: int) -> None:
    """Refuse ``--local-cluster N`` (SystemExit) with another Redis, or with too few primaries."""
    if primaries < rediscluster.MIN_PRIMARIES:
        raise SystemExit(f"--local-cluster {primaries}: a Redis Cluster needs {rediscluster.MIN_PRIMARIES} "
                         "primaries or more (a failover needs the votes of a majority of them)")
    if not needs_local_redis(settings, environ):
        raise SystemExit("--local-cluster starts its own Redis: leave out --redis-url, --redis-sentinels and "
                         "--redis-cluster (and their LMSP_ variables)")


def start_local_cluster(settings: Settings, primaries: int, children: list[subprocess.Popen[bytes]]) -> Settings:
    """A local Redis Cluster of ``primaries`` primaries, one replica each; ``settings`` that use it."""
    directory = data_dir() / "redis-cluster"
    rediscluster.clear_nodes(directory)  # the last cluster's ports are gone: its nodes cannot meet again
    nodes = rediscluster.start_cluster(directory, primaries, 1, children)
    logger.info("local Redis Cluster at %s (data in %s)", ", ".join(nodes), directory)
    return settings.replace(redis_cluster=",".join(nodes))


class Terminated(Exception):
    """SIGTERM reached ``lmsp up``."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # uvicorn handles SIGTERM itself while it serves, stops gracefully, restores this handler and
    # raises the signal again; left at SIG_DFL that kills the process before it stops its children.
    # A second SIGTERM while the children stop must not cut their shutdown short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def up(settings: Settings, models: list[str], local_cluster: int = 0) -> int:
    """Serve until stopped; ``local_cluster``: the primaries of a local Redis Cluster to start (0: none)."""
    logs.configure(settings.log_level, settings.log_json)
    if local_cluster:
        check_local_cluster(settings, os.environ, local_cluster)
    settings = auth_for_up(settings, os.environ)
    if settings.auth == "tokens":
        logger.info("the API on %s needs bearer tokens: create one with `lmsp token create --redis-url URL "
                    "--principal NAME --scopes ...`", settings.host)
    children: list[subprocess.Popen[bytes]] = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _serve(settings, models, children, local_cluster)
    except (Terminated, KeyboardInterrupt):
        logger.info("stopping")
    finally:
        stop_children(children)
        signal.signal(signal.SIGTERM, previous)
    return 0


def _serve(settings: Settings, models: list[str], children: list[subprocess.Popen[bytes]],
           local_cluster: int) -> None:
    """Start Redis (unless one is given) and the worker, appending them to ``children`` at once so
    that a signal at any point stops what was started; then serve the API until stopped."""
    if local_cluster:
        settings = start_local_cluster(settings, local_cluster, children)
    elif needs_local_redis(settings, os.environ):
        url = start_redis(data_dir() / "redis", children)
        settings = settings.replace(redis_url=url)
        logger.info("local redis-server at %s (data in %s)", url, data_dir() / "redis")
    env = {**os.environ, **settings.redis_env(), **settings.models_env()}  # the models named by path too
    worker_cmd = [sys.executable, "-m", "lmsp.cli", "worker"] + [arg for m in models for arg in ("--model", m)]
    children.append(subprocess.Popen(worker_cmd, env=env))
    logger.info("API on http://%s:%d, models: %s", settings.host, settings.port, ", ".join(models))
    from api.server import run

    run(settings)


def stop_children(children: list[subprocess.Popen[bytes]], timeout: float = 15) -> None:
    """Stop the newest child first and wait for it: the worker hands its tasks back through Redis,
    so Redis stops last. A child that outlasts ``timeout`` is killed, and so is every child left when
    a second Ctrl-C cuts the waiting short."""
    try:
        for child in reversed(children):
            if child.poll() is None:
                child.terminate()
            try:
                child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    except KeyboardInterrupt:
        for child in children:
            if child.poll() is None:
                child.kill()
        raise
