"""`lmsp up` runs the whole service on a fresh machine: local redis-server, a worker, the API; `lmsp principal`
sets weights and quotas."""

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from lmsp.up import needs_local_redis
from lmsp_core.requests.catalog import SMOLLM2
from lmsp_core.requests.modelfiles import package_file
from lmsp_core.settings import Settings
from lmsp_core.store.tenants import principals
from lmsp_core.store.tenants.principals import PrincipalSettings
from tests.support import ROOT, RedisServer, body, free_port, run_lmsp, service_env, wait_port


def descendants(pid: int) -> set[int]:
    """The living processes below ``pid`` (from /proc: children, their children, ...)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Up:
    """``lmsp up`` on a free port with the tiny random model (or the model flags given) and a data
    directory of its own; its output goes to a file (a pipe would stay open as long as any child holds it)."""

    def __init__(self, *model: str) -> None:
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")}
        self.env["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="lmsp-data-")
        self.env["LMSP_TORCH_THREADS"] = "1"
        self.log = Path(self.env["XDG_DATA_HOME"]) / "up.log"
        self.children: dict[int, bytes] = {}  # pid: command line
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "lmsp.cli", "up", "--port", str(self.port),
                 *(model or ("--model", "tiny-random"))],
                env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    async def ready(self, timeout: float = 120) -> None:
        wait_port(self.port, timeout=60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=60) as client:
            deadline = time.monotonic() + timeout
            while (await client.get("/readyz")).status_code != 200:
                assert time.monotonic() < deadline, "the worker never became ready"
                await asyncio.sleep(0.2)
        self.children = {pid: cmdline(pid) for pid in descendants(self.process.pid)}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def cleanup(self) -> None:
        """Kill whatever a failed test left running, children included."""
        left = descendants(self.process.pid) if self.process.poll() is None else set()
        # an orphaned child, if its pid still runs the same command (not a reused pid)
        left |= {pid for pid, command in self.children.items() if alive(pid) and cmdline(pid) == command}
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.env["XDG_DATA_HOME"], ignore_errors=True)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_lmsp_up_serves_requests_and_stops_its_children(stop: signal.Signals) -> None:
    up = Up()
    try:
        await up.ready()
        assert len(up.children) >= 2, up.children  # redis-server and the worker
        if stop == signal.SIGINT:  # one request is enough to show the whole chain works
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{up.port}", timeout=60) as client:
                response = await client.post("/lmsp/v1/responses", json=body(max_output_tokens=4))
                assert response.status_code == 200 and response.json()["usage"]["output_tokens"] == 4
                # the model it was given, not the rest of the built-in catalog
                assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["tiny-random"]
        up.process.send_signal(stop)
        assert up.process.wait(timeout=60) == 0, up.output()
        # every child is gone when `lmsp up` returns (systemd and docker stop wait for that)
        assert not [pid for pid in up.children if alive(pid)], up.output()
        assert "Traceback" not in up.output()
        # the local Redis kept its append-only file in the data directory
        assert (Path(up.env["XDG_DATA_HOME"]) / "lmsp" / "redis").is_dir()
    finally:
        up.cleanup()


@pytest.mark.smollm2
async def test_lmsp_up_serves_a_gguf_file_given_by_path() -> None:
    """As a newcomer types it: the file and nothing else. It is served under its name, with the context
    window of its metadata (the first start converts it, as it does the packaged default model)."""
    gguf = package_file(SMOLLM2.source.partition(":")[2])
    up = Up("--model", str(gguf))
    try:
        await up.ready(timeout=600)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{up.port}", timeout=120) as client:
            model = (await client.get("/lmsp/v1/models/SmolLM2-135M-Instruct.Q4_1")).json()
            assert (model["status"], model["context_window"]) == ("available", 8192), model
            # a client that takes the first model listed takes the one served
            listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            assert listed == ["SmolLM2-135M-Instruct.Q4_1"], listed
            answer = await client.post("/v1/chat/completions", json={
                "model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert answer.status_code == 200, answer.text
            assert "Paris" in answer.json()["choices"][0]["message"]["content"]
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(timeout=60) == 0, up.output()
        assert "Traceback" not in up.output()
    finally:
        up.cleanup()


def test_lmsp_up_starts_its_own_redis_only_without_url_or_sentinels() -> None:
    assert needs_local_redis(Settings(), {})
    assert not needs_local_redis(Settings(redis_url="redis://10.0.0.2:6379/0"), {})
    assert not needs_local_redis(Settings(), {"LMSP_REDIS_URL": Settings().redis_url})
    sentinels = Settings(redis_sentinels="10.0.0.3:26379", redis_master="lmsp")
    assert not needs_local_redis(sentinels, {})
    # the worker it starts gets the same Redis, flags included
    assert sentinels.redis_env()["LMSP_REDIS_SENTINELS"] == "10.0.0.3:26379"


async def test_lmsp_principal_sets_shows_and_lists_weights_and_quotas(redis_server: RedisServer,
                                                                      redis: aioredis.Redis) -> None:
    env = service_env(redis_server.url)

    def lmsp(*args: str, **settings: str) -> subprocess.CompletedProcess[str]:
        return run_lmsp("principal", *args, env={**env, **settings})

    def line(result: subprocess.CompletedProcess[str]) -> str:
        assert result.returncode == 0 and result.stdout.count("\n") == 1, result
        return result.stdout.rstrip("\n")

    try:
        assert line(lmsp("set", "cli-fair-a", "--weight", "2.5", "--max-running", "2", "--max-queued", "10")) == \
            "cli-fair-a\tweight=2.5\tmax_running=2\tmax_queued=10"
        assert await principals.get(redis, "cli-fair-a") == PrincipalSettings(weight=2.5, max_running=2, max_queued=10)
        # only the fields given change; none lifts a quota
        assert line(lmsp("set", "cli-fair-a", "--max-running", "none")) == \
            "cli-fair-a\tweight=2.5\tmax_running=-\tmax_queued=10"
        assert line(lmsp("set", "cli-fair-b", "--max-queued", "3")) == \
            "cli-fair-b\tweight=1\tmax_running=-\tmax_queued=3"
        assert line(lmsp("show", "cli-fair-b")) == "cli-fair-b\tweight=1\tmax_running=-\tmax_queued=3"
        listing = lmsp("list").stdout.splitlines()
        assert [entry for entry in listing if entry.startswith("cli-fair-")] == [
            "cli-fair-a\tweight=2.5\tmax_running=-\tmax_queued=10", "cli-fair-b\tweight=1\tmax_running=-\tmax_queued=3"]
        names = [entry.split("\t")[0] for entry in listing]
        assert names == sorted(names)
        # a bad value or name: one line, exit status 2, nothing written
        for args, said in ((("set", "cli-fair-a", "--weight", "0"), "--weight '0': expected `float` > 0.0"),
                           (("set", "cli-fair-a", "--max-running", "abc"), "--max-running 'abc': expected `int"),
                           (("set", "cli-fair-a"), "nothing to set"), (("show", "bad name"), "Principal 'bad name'")):
            bad = lmsp(*args)
            assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1, bad
            assert bad.stderr.startswith(f"lmsp principal: {said}"), bad.stderr
        assert await principals.get(redis, "cli-fair-a") == PrincipalSettings(weight=2.5, max_queued=10)
        # back to the defaults: forgotten (shown with the defaults, listed no more); a change that no
        # replica confirmed is written all the same, with a warning
        cleared = lmsp("set", "cli-fair-b", "--max-queued", "none", LMSP_REDIS_WAIT_REPLICAS="1")
        assert line(cleared) == "cli-fair-b\tweight=1\tmax_running=-\tmax_queued=-"
        assert "warning: no replica confirmed the change" in cleared.stderr
        assert "cli-fair-b" not in await principals.load(redis)
        assert line(lmsp("show", "cli-fair-b")) == "cli-fair-b\tweight=1\tmax_running=-\tmax_queued=-"
    finally:
        for name in ("cli-fair-a", "cli-fair-b"):
            await principals.store(redis, name, principals.DEFAULT)
