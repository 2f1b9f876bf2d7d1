"""Every event stream's frames, in one place: the LMSP task logs (6.3, 6.4), OpenAI's Responses
events and its chat chunks. ``api.follow.streams`` runs the loop; a framer turns what the loop
hands it into bytes.

LMSP frames are the stored events as they are: ``id`` is the event number, ``event`` its name,
``data`` the stored JSON, so every event has an id (6.3). While a task waits in its queue, a tasks
stream also tells its queue position: as a comment (``: queued 3``, a block of its own) by default,
which is no event; as a ``task.queued`` event without id only for a client that asked for them
(``?queue_events=true``), since it is not part of the task's log. The ``/v1`` streams are as OpenAI
sends them: Responses events as ``event: <type>`` and ``data: <json>`` (no ``id`` field:
``sequence_number`` in the data is the cursor), chat chunks as ``data: <json>`` ending with
``data: [DONE]``. If Redis goes away mid-stream, each kind ends with its own error frame.

The keep-alive, the same on every stream, is a comment line on its own (``: keep-alive`` and one
newline): no SSE parser dispatches anything for it, whereas a comment followed by a blank line
makes some (httpx-sse, the ``openai`` package's once it saw an ``id``) produce an event with empty
data.

Frames are written here rather than by Litestar's ``ServerSentEvent``: the events of a batch go
out as one chunk of bytes formatted without decoding the JSON, which is most of what relaying
costs when a thousand clients follow one task (docs/performance.md).
"""

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Literal

import msgspec
from litestar.response import Stream

from api.openai import objects as oa
from api.openai.chat import ChunkRenderer
from api.openai.errors import error_object
from api.openai.rendering import EventRenderer, ResponseView
from api.process import Services
from lmsp_core import wire
from lmsp_core.store.tasks import queue
from lmsp_core.store.tasks.eventlog import Event
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire.errors import ServiceUnavailable

KEEPALIVE = b": keep-alive\n"
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

QueueNotices = Literal["none", "comments", "events"]
QUEUE_COMMENTS: QueueNotices = "comments"
QUEUE_EVENTS: QueueNotices = "events"

_LOST_TASK = "The service's store became unreachable; reconnect with Last-Event-ID."
_LOST_RESPONSE = ("The service's store became unreachable; resume with starting_after the last sequence_number "
                  "received.")
_LOST_COMPLETION = "The service's store became unreachable; the completion is lost."


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


def event_frames(events: Sequence[oa.StreamEvent]) -> bytes:
    return b"".join(b"event: %s\ndata: %s\n\n" % (type(event).__struct_config__.tag.encode(),  # type: ignore[union-attr]
                                                  oa.encoder.encode(event)) for event in events)


def data_frame(payload: object) -> bytes:
    return b"data: " + oa.encoder.encode(payload) + b"\n\n"


class TaskFrames:
    """A task's log as LMSP sends it, with its queue position while it waits, as ``notices`` says."""

    def __init__(self, services: Services, record: TaskRecord, notices: QueueNotices = "none") -> None:
        self.services = services
        self.record = record
        self.notices = notices
        self.waiting = notices != "none" and record.status == "queued"

    async def opening(self) -> bytes:
        return await self.idle()

    def events(self, batch: list[Event]) -> bytes:
        self.waiting = False
        return frames(batch)

    async def idle(self) -> bytes:
        if not self.waiting:
            return b""
        position = await queue.queue_position(self.services.redis, self.record.id, self.record.model,
                                              self.record.job, fair=self.services.settings.fair_share)
        if position is None:
            return b""
        if self.notices == QUEUE_COMMENTS:
            # a block of its own: parsers that split the stream at blank lines never find it glued
            # to the next event
            return b": queued %d\n\n" % position
        return frame(wire.QUEUED, msgspec.json.encode(wire.TaskQueued(task_id=self.record.id,
                                                                      queue_position=position)))

    def end(self) -> bytes:
        return b""

    def lost(self) -> bytes:
        problem = ServiceUnavailable(_LOST_TASK)
        return frame(wire.ERROR, msgspec.json.encode(wire.ErrorEventData(error=problem.problem())))


class ResponseFrames:
    """A task's events rendered for ``/v1/responses``, those numbered above ``after``."""

    def __init__(self, view: ResponseView, after: int = -1) -> None:
        self.renderer = EventRenderer(view)
        self.after = after
        self.sent = after

    async def opening(self) -> bytes:
        return self._sending([event for event in self.renderer.opening() if event.sequence_number > self.after])

    def events(self, batch: list[Event]) -> bytes:
        return self._sending([rendered for event in batch for rendered in self.renderer.render(event)
                              if rendered.sequence_number > self.after])

    async def idle(self) -> bytes:
        return b""

    def end(self) -> bytes:
        return b""

    def lost(self) -> bytes:
        return self.encode([oa.StreamError(sequence_number=self.sent, code=ServiceUnavailable.default_code,
                                           message=_LOST_RESPONSE)])

    def encode(self, events: list[oa.StreamEvent]) -> bytes:
        """The events as this stream sends them: SSE frames (a WebSocket's messages:
        ``api.follow.sockets``)."""
        return event_frames(events)

    def _sending(self, events: list[oa.StreamEvent]) -> bytes:
        if events:
            self.sent = events[-1].sequence_number
        return self.encode(events)


class ChatFrames:
    """A task's events as chat completion chunks, then ``[DONE]`` (a failure ends the stream with an
    error object instead)."""

    def __init__(self, record: TaskRecord, include_usage: bool) -> None:
        self.renderer = ChunkRenderer(record, include_usage)
        self.failed = False

    async def opening(self) -> bytes:
        return b""

    def events(self, batch: list[Event]) -> bytes:
        sent = []
        for event in batch:
            for chunk in self.renderer.render(event):
                self.failed = self.failed or isinstance(chunk, wire.Problem)
                sent.append(data_frame(error_object(chunk) if isinstance(chunk, wire.Problem) else chunk))
        return b"".join(sent)

    async def idle(self) -> bytes:
        return b""

    def end(self) -> bytes:
        return b"" if self.failed else DONE

    def lost(self) -> bytes:
        return data_frame(error_object(ServiceUnavailable(_LOST_COMPLETION).problem()))
