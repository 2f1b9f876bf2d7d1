"""`lmsp up` runs the whole service on a fresh machine: local redis-server, a worker, the API."""

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from lmsp.up import needs_local_redis
from lmsp_core.settings import Settings
from tests.support import ROOT, body, free_port, wait_port


async def test_lmsp_up_serves_requests_and_stops_cleanly() -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")}
    env["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="lmsp-data-")
    process = subprocess.Popen([sys.executable, "-m", "lmsp.cli", "up", "--port", str(port), "--model", "tiny-random"],
                               env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_port(port, timeout=60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 120
            while (await client.get("/readyz")).status_code != 200:
                assert time.monotonic() < deadline, "the worker never became ready"
                await asyncio.sleep(0.2)
            response = await client.post("/lmsp/v1/responses", json=body(max_output_tokens=4))
            assert response.status_code == 200 and response.json()["usage"]["output_tokens"] == 4
    finally:
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=60)[0].decode(errors="replace")
    assert process.returncode == 0, output
    assert "Traceback" not in output
    # the local Redis kept its append-only file in the data directory
    assert os.path.isdir(os.path.join(env["XDG_DATA_HOME"], "lmsp", "redis"))


def test_lmsp_up_starts_its_own_redis_only_without_url_or_sentinels() -> None:
    assert needs_local_redis(Settings(), {})
    assert not needs_local_redis(Settings(redis_url="redis://10.0.0.2:6379/0"), {})
    assert not needs_local_redis(Settings(), {"LMSP_REDIS_URL": Settings().redis_url})
    sentinels = Settings(redis_sentinels="10.0.0.3:26379", redis_master="lmsp")
    assert not needs_local_redis(sentinels, {})
    # the worker it starts gets the same Redis, flags included
    assert sentinels.redis_env()["LMSP_REDIS_SENTINELS"] == "10.0.0.3:26379"
