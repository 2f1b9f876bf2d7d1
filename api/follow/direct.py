"""Direct responses: tasks whose lifetime is their HTTP connection (``POST /lmsp/v1/responses`` and
the OpenAI routes without ``background``). A client that goes away before the final event cancels
its task, unless it sent an ``Idempotency-Key`` (it said it will repeat the request)."""

import asyncio
import contextlib

import anyio
from litestar.types import Receive
from redis.exceptions import RedisError

from api.process import Services
from lmsp_core.store.tasks.records import TaskRecord


async def final_or_disconnect(services: Services, record: TaskRecord, receive: Receive) -> bool:
    """Wait for the task's final event; False if the client disconnects first."""
    final = asyncio.create_task(_drain(services, record))
    gone = asyncio.create_task(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (final, gone):
            task.cancel()
    if final in done:
        final.result()  # re-raises a Redis failure
        return True
    return False


async def _drain(services: Services, record: TaskRecord) -> None:
    async for _ in services.hub.follow(record, 0):
        pass


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel(services: Services, record: TaskRecord) -> None:
    """Cancel a task whose client went away (shielded: it runs while the request is being torn down)."""
    with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
        await services.store.cancel(record)
