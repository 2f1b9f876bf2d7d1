"""The ``/v1`` event streams, as OpenAI sends them: Responses events as ``event: <type>`` and
``data: <json>`` (no ``id`` field: ``sequence_number`` in the data is the cursor), chat chunks as
``data: <json>`` ending with ``data: [DONE]``.

Keep-alives are a comment line on its own (``: keep-alive`` and one newline): no SSE parser
dispatches anything for it, whereas a comment followed by a blank line makes some (httpx-sse,
the ``openai`` package's once it saw an ``id``) produce an event with empty data.
"""

from collections.abc import AsyncIterator, Sequence

from redis.exceptions import RedisError

from api.follow import direct
from api.openai import objects as oa
from api.openai.chat import ChunkRenderer
from api.openai.errors import error_object
from api.openai.rendering import EventRenderer, ResponseView
from api.process import Services
from lmsp_core import wire
from lmsp_core.store.tasks import TaskRecord
from lmsp_core.wire.errors import ServiceUnavailable

HEARTBEAT = b": keep-alive\n"
DONE = b"data: [DONE]\n\n"
_LOST = "The service's store became unreachable; resume with starting_after the last sequence_number received."


def event_frames(events: Sequence[oa.StreamEvent]) -> bytes:
    return b"".join(b"event: %s\ndata: %s\n\n" % (type(event).__struct_config__.tag.encode(),  # type: ignore[union-attr]
                                                  oa.encoder.encode(event)) for event in events)


def data_frame(payload: object) -> bytes:
    return b"data: " + oa.encoder.encode(payload) + b"\n\n"


async def response_events(services: Services, view: ResponseView, after: int = -1, *,
                          cancel: bool = False) -> AsyncIterator[bytes]:
    """The task's events rendered for ``/v1/responses``, those numbered above ``after``, up to the
    final one. With ``cancel`` (a direct response without Idempotency-Key) a client that leaves
    before the end cancels the task."""
    record = view.record
    renderer = EventRenderer(view)
    sent = after
    ended = False
    gauge = services.metrics.open_streams.labels(record.kind)
    gauge.inc()
    try:
        opening = [event for event in renderer.opening() if event.sequence_number > after]
        if opening:
            yield event_frames(opening)
            sent = opening[-1].sequence_number
        async for batch in services.hub.follow(record, 0):
            if batch is None:
                yield HEARTBEAT
                continue
            events = [rendered for event in batch for rendered in renderer.render(event)
                      if rendered.sequence_number > after]
            if events:
                yield event_frames(events)
                sent = events[-1].sequence_number
        ended = True
    except (RedisError, OSError):
        yield event_frames([oa.StreamError(sequence_number=sent, code=ServiceUnavailable.default_code, message=_LOST)])
    finally:
        gauge.dec()
        if cancel and not ended:  # the client went away
            await direct.cancel(services, record)


async def chat_chunks(services: Services, record: TaskRecord, *, include_usage: bool,
                      cancel: bool) -> AsyncIterator[bytes]:
    """The task's events as chat completion chunks, then ``[DONE]`` (a failure ends the stream with an
    error object instead)."""
    renderer = ChunkRenderer(record, include_usage)
    ended = failed = False
    gauge = services.metrics.open_streams.labels(record.kind)
    gauge.inc()
    try:
        async for batch in services.hub.follow(record, 0):
            if batch is None:
                yield HEARTBEAT
                continue
            frames = []
            for event in batch:
                for chunk in renderer.render(event):
                    failed = failed or isinstance(chunk, wire.Problem)
                    frames.append(data_frame(error_object(chunk) if isinstance(chunk, wire.Problem) else chunk))
            if frames:
                yield b"".join(frames)
        ended = True
        if not failed:
            yield DONE
    except (RedisError, OSError):
        problem = ServiceUnavailable("The service's store became unreachable; the completion is lost.").problem()
        yield data_frame(error_object(problem))
    finally:
        gauge.dec()
        if cancel and not ended:
            await direct.cancel(services, record)

