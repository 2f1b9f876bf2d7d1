"""Live workers and the model cards they publish.

A worker heartbeats into a sorted set (score: the time its heartbeat expires) and keeps a small
hash describing itself (``warming`` while it loads and warms up its models, then ``ready``);
readers drop entries whose heartbeat lapsed. The model card (tokenizer and
chat template) lets API processes on other hosts count prompt tokens exactly as the worker does.
"""

import os
import secrets
import socket
import time
from collections import Counter
from typing import Literal

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from lmsp_core.requests.chat import ModelCard, card_digest
from lmsp_core.store import keys


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    models: list[str]
    host: str
    pid: int
    started_at: float
    device: str
    # "warming" while it loads its models and warms them up (compiling), then "ready" for jobs
    state: Literal["warming", "ready"] = "ready"
    running: dict[str, int] = {}  # tasks running now, per model (as of the last heartbeat)
    slots: dict[str, int] = {}  # the KV slots of each model's engine
    slots_used: dict[str, int] = {}  # ... held by sequences (as of the last heartbeat)


def new_worker(models: list[str], device: str) -> WorkerInfo:
    """A worker that is starting: a fresh id, ``warming``."""
    host, pid = socket.gethostname(), os.getpid()
    return WorkerInfo(id=f"{host}-{pid}-{secrets.token_hex(3)}", models=models, host=host, pid=pid,
                      started_at=time.time(), device=device, state="warming")


async def publish_card(redis: Redis, card: ModelCard) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(keys.model_card(card.model_id), msgspec.json.encode(card))
        pipe.set(keys.model_card_digest(card.model_id), card_digest(card))
        await pipe.execute()


async def card_digest_of(redis: Redis, model_id: str) -> str | None:
    raw = await redis.get(keys.model_card_digest(model_id))
    return None if raw is None else str(raw.decode())


async def load_card(redis: Redis, model_id: str) -> ModelCard | None:
    raw = await redis.get(keys.model_card(model_id))
    return None if raw is None else msgspec.json.decode(raw, type=ModelCard)


async def heartbeat(redis: Redis, info: WorkerInfo, ttl: float) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        add_heartbeat(pipe, info, ttl)
        await pipe.execute()


def add_heartbeat(pipe: Pipeline, info: WorkerInfo, ttl: float) -> None:
    expires_ms = int((time.time() + ttl) * 1000)
    pipe.zadd(keys.workers(), {info.id: expires_ms})
    pipe.set(keys.worker(info.id), msgspec.json.encode(info), px=int(ttl * 1000))


async def deregister(redis: Redis, worker_id: str) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrem(keys.workers(), worker_id)
        pipe.delete(keys.worker(worker_id))
        await pipe.execute()


async def live_workers(redis: Redis) -> list[WorkerInfo]:
    now_ms = int(time.time() * 1000)
    await redis.zremrangebyscore(keys.workers(), "-inf", now_ms)
    ids = await redis.zrange(keys.workers(), 0, -1)
    if not ids:
        return []
    raw = await redis.mget([keys.worker(worker_id.decode()) for worker_id in ids])
    return [msgspec.json.decode(item, type=WorkerInfo) for item in raw if item is not None]


async def workers_per_model(redis: Redis) -> Counter[str]:
    """Live workers ready to take jobs, per model (warming ones do not count)."""
    return ready_per_model(await live_workers(redis))


def ready_per_model(workers: list[WorkerInfo]) -> Counter[str]:
    return Counter(model for info in workers if info.state == "ready" for model in info.models)


def models_run(workers: list[WorkerInfo]) -> set[str]:
    """The models some live worker runs, warming or ready."""
    return {model for info in workers for model in info.models}


def warming_per_model(workers: list[WorkerInfo]) -> Counter[str]:
    return Counter(model for info in workers if info.state == "warming" for model in info.models)
