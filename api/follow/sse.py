"""Task event logs as server-sent events (6.3, 6.4).

Stored events go out as they are: ``id`` is the event number, ``event`` its name, ``data`` the
stored JSON, so every event has an id (6.3). Comments keep idle connections open. While a task
waits in its queue, a tasks stream also tells its queue position: as a comment (``: queued 3``,
a block of its own like a keep-alive) by default, which is no event; as a ``task.queued`` event
without id only for a client that asked for them (``?queue_events=true``), since it is not part of
the task's log. If Redis goes away mid-stream, an ``error`` event ends the stream.

Frames are written here rather than by Litestar's ``ServerSentEvent``: the events of a batch go
out as one chunk of bytes formatted without decoding the JSON, which is most of what relaying
costs when a thousand clients follow one task (docs/performance.md).
"""

from collections.abc import AsyncIterator, Mapping
from typing import Literal

import msgspec
from litestar.response import Stream
from redis.exceptions import RedisError

from api.process import Services
from lmsp_core import wire
from lmsp_core.store import queue
from lmsp_core.store.eventlog import Event
from lmsp_core.store.tasks import TaskRecord
from lmsp_core.wire.errors import ServiceUnavailable

HEARTBEAT = b": keep-alive\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

QueueNotices = Literal["none", "comments", "events"]
QUEUE_COMMENTS: QueueNotices = "comments"
QUEUE_EVENTS: QueueNotices = "events"


def response(chunks: AsyncIterator[bytes], headers: Mapping[str, str] | None = None) -> Stream:
    """An event-stream response (with the headers of 6.3) sending ``chunks`` as they come."""
    return Stream(chunks, media_type="text/event-stream", headers={**HEADERS, **(headers or {})})


def frame(name: str, data: bytes, event_id: int | None = None) -> bytes:
    head = b"" if event_id is None else b"id: %d\n" % event_id
    # JSON from our encoders never holds a raw line break; split anyway rather than corrupt the stream
    body = b"data: " + data if b"\n" not in data else b"\n".join(b"data: " + line for line in data.split(b"\n"))
    return head + b"event: " + name.encode() + b"\n" + body + b"\n\n"


def frames(events: list[Event]) -> bytes:
    return b"".join(frame(event.name, event.data, event.id) for event in events)


async def queued_notice(services: Services, record: TaskRecord, kind: QueueNotices) -> bytes | None:
    position = await queue.queue_position(services.redis, record.id, record.model, record.job,
                                          fair=services.settings.fair_share)
    if position is None:
        return None
    if kind == QUEUE_COMMENTS:
        # a block of its own, as the keep-alives: parsers that split the stream at blank lines
        # never find it glued to the next event
        return b": queued %d\n\n" % position
    return frame(wire.QUEUED, msgspec.json.encode(wire.TaskQueued(task_id=record.id, queue_position=position)))


async def relay(services: Services, record: TaskRecord, after: int, *,
                queue_notices: QueueNotices = "none") -> AsyncIterator[bytes]:
    """The task's events after ``after`` up to the final one, then the end of the stream; while the
    task is queued, its queue position as ``queue_notices`` says."""
    gauge = services.metrics.open_streams.labels(record.kind)
    gauge.inc()
    waiting = queue_notices != "none" and record.status == "queued"
    try:
        if waiting and (notice := await queued_notice(services, record, queue_notices)):
            yield notice
        async for batch in services.hub.follow(record, after):
            if batch is None:
                yield HEARTBEAT
                if waiting and (notice := await queued_notice(services, record, queue_notices)):
                    yield notice
                continue
            waiting = False
            yield frames(batch)
    except (RedisError, OSError):
        problem = ServiceUnavailable("The service's store became unreachable; reconnect with Last-Event-ID.")
        yield frame(wire.ERROR, msgspec.json.encode(wire.ErrorEventData(error=problem.problem())))
    finally:
        gauge.dec()
