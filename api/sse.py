"""Task event logs as server-sent events (6.3, 6.4).

Stored events go out as they are: ``id`` is the event number, ``event`` its name, ``data`` the
stored JSON. Comments keep idle connections open. A tasks stream also gets ``task.queued``
notices with the queue position while the task waits; they carry no id because they are not part
of the task's log. If Redis goes away mid-stream, an ``error`` event ends the stream.
"""

from collections.abc import AsyncIterator

import msgspec
from litestar.response import ServerSentEventMessage
from redis.exceptions import RedisError

from api.services import Services
from lmsp_core import queue, wire
from lmsp_core.errors import ServiceUnavailable
from lmsp_core.tasks import TaskRecord

HEARTBEAT = ServerSentEventMessage(comment="keep-alive")


def message(event_id: int, name: str, data: bytes) -> ServerSentEventMessage:
    return ServerSentEventMessage(id=event_id, event=name, data=data.decode())


async def queued_notice(services: Services, record: TaskRecord) -> ServerSentEventMessage | None:
    position = await queue.queue_position(services.redis, record.id, record.model, record.job)
    if position is None:
        return None
    data = msgspec.json.encode(wire.TaskQueued(task_id=record.id, queue_position=position))
    return ServerSentEventMessage(event=wire.QUEUED, data=data.decode())


async def relay(services: Services, record: TaskRecord, after: int, *,
                queue_notices: bool = False) -> AsyncIterator[ServerSentEventMessage]:
    """The task's events after ``after`` up to the final one, then the end of the stream."""
    gauge = services.metrics.open_streams.labels(record.kind)
    gauge.inc()
    try:
        async for message in _relay(services, record, after, queue_notices):
            yield message
    finally:
        gauge.dec()


async def _relay(services: Services, record: TaskRecord, after: int,
                 queue_notices: bool) -> AsyncIterator[ServerSentEventMessage]:
    waiting = queue_notices and record.status == "queued"
    try:
        if waiting and (notice := await queued_notice(services, record)):
            yield notice
        async for event in services.hub.follow(record.id, after, services.settings.sse_heartbeat):
            if event is None:
                yield HEARTBEAT
                if waiting and (notice := await queued_notice(services, record)):
                    yield notice
                continue
            waiting = False
            yield message(event.id, event.name, event.data)
    except (RedisError, OSError):
        problem = ServiceUnavailable("The service's store became unreachable; reconnect with Last-Event-ID.")
        yield ServerSentEventMessage(event=wire.ERROR, data=msgspec.json.encode(
            wire.ErrorEventData(error=problem.problem())).decode())
