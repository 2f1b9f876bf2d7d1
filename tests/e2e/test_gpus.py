"""``lmsp worker --gpus``: one worker process per GPU, each pinned with CUDA_VISIBLE_DEVICES.

This machine has no GPU: the children run their models on the CPU, but everything the supervisor
does (one process per listed device, the pinning, shared queues, restarts, shutdown) is the same."""

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from tests.support import Api, RedisServer, Service, body, service_env
from workers.supervisor import parse_gpus


def test_gpus_option() -> None:
    assert parse_gpus("0,1", {}) == ["0", "1"]
    assert parse_gpus(" 2 , GPU-5f1c ", {}) == ["2", "GPU-5f1c"]
    assert parse_gpus("all", {"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        parse_gpus("all", {})  # no GPU here
    for bad in ("", ",", "0,0"):
        with pytest.raises(SystemExit, match="distinct GPU ids"):
            parse_gpus(bad, {})


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


async def _children(redis: aioredis.Redis, supervisor: int, count: int, exclude: set[int] = frozenset(),
                    timeout: float = 120) -> dict[int, str]:
    """Ready workers (model loaded and warmed up) registered in Redis whose parent is the supervisor
    -> their CUDA_VISIBLE_DEVICES."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for key in await redis.keys("lmsp:{workers}:worker:*"):
            raw = await redis.get(key)
            info = msgspec.json.decode(raw) if raw else {}
            pid = info.get("pid", 0) if info.get("state", "ready") == "ready" else 0
            if pid and pid not in exclude and Path(f"/proc/{pid}").exists() and _parent(pid) == supervisor:
                found[pid] = _environ(pid).get("CUDA_VISIBLE_DEVICES", "")
        if len(found) >= count:
            return found
        await asyncio.sleep(0.2)
    raise TimeoutError(f"expected {count} workers of supervisor {supervisor}")


async def test_one_worker_per_gpu_on_shared_queues(redis_server: RedisServer, models_file: str, api: Api) -> None:
    url = redis_server.url
    redis = aioredis.Redis.from_url(url)
    # a model only these workers serve, so that no other worker of the session takes its tasks
    supervisor = Service(["worker", "--gpus", "0,1", "--model", "tiny-pinned"],
                         service_env(url, models_file=models_file), "gpus").start()
    try:
        assert supervisor.process is not None
        children = await _children(redis, supervisor.process.pid, 2)
        assert sorted(children.values()) == ["0", "1"]
        async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
            # tiny-pinned runs one task at a time per worker: two long tasks at once need both workers
            created = [(await client.post("/lmsp/v1/tasks", json=body("tiny-pinned", max_output_tokens=400))).json()
                       for _ in range(2)]
            workers = set()
            for task in created:
                while (state := (await client.get(f"/lmsp/v1/tasks/{task['id']}")).json())["status"] in (
                        "queued", "in_progress"):
                    await asyncio.sleep(0.1)
                assert state["status"] in ("completed", "incomplete")
                workers.add((await redis.hget(f"lmsp:task:{{{task['id']}}}", "worker") or b"").decode())
            # both GPUs' workers took a task from the same queue
            assert {int(worker.split("-")[-2]) for worker in workers} == set(children)

        # a worker that dies is started again, on the same GPU
        victim, gpu = next(iter(children.items()))
        os.kill(victim, signal.SIGKILL)
        restarted = await _children(redis, supervisor.process.pid, 1, exclude=set(children))
        assert list(restarted.values()) == [gpu]

        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0
        alive = set(children) | set(restarted)
        assert not [pid for pid in alive if Path(f"/proc/{pid}").exists() and _parent(pid) == supervisor.process.pid]
    finally:
        supervisor.stop()
        await redis.aclose()
