"""Task records read straight from Redis: what the API stored behind a response, and whose they are."""

import asyncio

import redis.asyncio as aioredis

from lmsp_core import wire


async def task_of_response(redis: aioredis.Redis, response_id: str) -> dict[bytes, bytes]:
    """The task hash behind a response, stored or not."""
    async for key in redis.scan_iter(match="lmsp:task:{*}", count=1000):
        if key.endswith(b"}") and await redis.hget(key, "response_id") == response_id.encode():
            return await redis.hgetall(key)
    raise AssertionError(f"no task for {response_id}")


async def final_status(redis: aioredis.Redis, response_id: str, timeout: float = 10) -> dict[bytes, bytes]:
    """The task hash behind a response once final, or as it is after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        task = await task_of_response(redis, response_id)
        if task[b"status"].decode() in wire.FINAL_STATUSES or asyncio.get_running_loop().time() > deadline:
            return task
        await asyncio.sleep(0.05)


async def tasks_of(redis: aioredis.Redis, principal: str) -> list[str]:
    """Ids of the task records (tasks and direct responses) that belong to a principal."""
    found = []
    async for key in redis.scan_iter(match="lmsp:task:{*}", count=1000):
        if await redis.type(key) == b"hash" and await redis.hget(key, "owner") == principal.encode():
            found.append((await redis.hget(key, "id")).decode())
    return found
