"""Turning a validated request into a queued task: model checks, the task record, the job."""

import asyncio
import contextlib
import time

from redis.exceptions import RedisError

from api.services import Services
from lmsp_core import ids, metrics, queue, registry, wire
from lmsp_core.errors import ServiceUnavailable
from lmsp_core.tasks import Kind, TaskRecord
from lmsp_core.validation import check_request, output_budget


async def submit(services: Services, request: wire.ResponseRequest, *, kind: Kind, owner: str) -> TaskRecord:
    """Check the request against its model and queue it. Raises LmspError for bad requests."""
    spec = services.catalog.get(request.model)
    check_request(request, spec)
    if kind == "direct" and not (await registry.workers_per_model(services.redis))[spec.id]:
        raise ServiceUnavailable(f"No worker is running model {spec.id!r} right now; retry later, or create "
                                 "a task, which waits in the queue for a worker.", code="model_unavailable",
                                 retry_after=5)
    renderer = await services.renderer(spec.id)
    if renderer is not None:  # else the worker checks the context length when it starts the task
        prompt = await asyncio.to_thread(renderer.prompt_ids, request.input)
        output_budget(request, spec, len(prompt))
    record = TaskRecord(
        id=ids.new_id(ids.TASK), model=spec.id, owner=owner, kind=kind, status="queued",
        created_at=time.time(), response_id=ids.new_id(ids.RESPONSE), request=wire.encoder.encode(request),
    )
    await services.store.create(record)
    try:
        await queue.enqueue(services.redis, record.id, spec.id)
    except RedisError:
        await _forget(services, record)
        raise
    with contextlib.suppress(RedisError):  # the task is queued; a lost count is not worth an error
        await metrics.add_now(services.redis, metrics.CREATED, (spec.id, kind))
    return record


async def _forget(services: Services, record: TaskRecord) -> None:
    # if Redis is gone the orphan record stays; it is never run, and the client saw an error
    with contextlib.suppress(RedisError):
        await services.store.delete(record)
