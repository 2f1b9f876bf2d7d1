"""What the sync and async clients share: configuration, request bodies, typed events, the resume
policy of task event streams. No I/O here."""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from httpx_sse import ServerSentEvent

from lmsp.client.errors import APIStatusError, StreamError
from lmsp_core import wire

DEFAULT_URL = "http://127.0.0.1:8000"
# a stream carries a keep-alive comment every LMSP_SSE_HEARTBEAT seconds (10 by default): a read
# that waits much longer than that is on a dead connection
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)

InputLike = str | Sequence[wire.InputItem | Mapping[str, Any]]
Form = tuple[dict[str, Any], dict[str, str]]  # a multipart body: httpx's ``files`` and ``data``

EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    wire.CREATED: wire.ResponseCreated,
    wire.ITEM_ADDED: wire.OutputItemAdded,
    wire.TEXT_DELTA: wire.OutputTextDelta,
    wire.ITEM_DONE: wire.OutputItemDone,
    wire.COMPLETED: wire.ResponseCompleted,
    wire.INCOMPLETE: wire.ResponseIncomplete,
    wire.FAILED: wire.ResponseFailed,
    wire.CANCELLED: wire.ResponseCancelled,
    wire.ERROR: wire.ErrorEventData,
    wire.QUEUED: wire.TaskQueued,
    wire.REASONING_DELTA: wire.ReasoningSummaryTextDelta,
}


class Event(msgspec.Struct, frozen=True):
    """One server-sent event. ``data`` is the wire Struct of a known event (``wire.OutputTextDelta``,
    ...), the decoded JSON of an unknown one (which clients must ignore, 6.3). ``id`` is None for
    events outside the task's log (``task.queued``, sent only when asked for)."""

    name: str
    data: Any
    id: int | None = None

    @property
    def final(self) -> bool:
        return self.name in wire.FINAL_EVENTS

    @property
    def delta(self) -> str:
        """The text of a ``response.output_text.delta``, else ``""``."""
        return self.data.delta if isinstance(self.data, wire.OutputTextDelta) else ""


@dataclass(frozen=True)
class Config:
    url: str
    headers: dict[str, str]

    @classmethod
    def create(cls, url: str | None, token: str | None) -> "Config":
        token = token if token is not None else os.environ.get("LMSP_TOKEN")
        headers = {"LMSP-Version": "1.0"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return cls((url or os.environ.get("LMSP_URL") or DEFAULT_URL).rstrip("/"), headers)


def user_message(text: str) -> wire.Message:
    return wire.Message(role="user", content=[wire.InputText(text=text)])


def request_body(model: str, input: InputLike, **options: Any) -> bytes:
    """The JSON body of a response or task request. ``input`` is a prompt string (one user message)
    or input items (wire Structs or dicts). Raises ``msgspec.ValidationError`` (a ValueError) for
    a request the service would refuse anyway."""
    items = [user_message(input)] if isinstance(input, str) else list(input)
    fields = {name: value for name, value in options.items() if value is not None}
    raw = {"model": model, "input": msgspec.to_builtins(items), **msgspec.to_builtins(fields)}
    return wire.encoder.encode(msgspec.convert(raw, wire.ResponseRequest))


class EventDecoder:
    """Turns parsed SSE messages into typed events and keeps the resume cursor: the last event id
    seen. An event without its own id (the SSE parser repeats the previous one) never moves it."""

    def __init__(self, cursor: int = 0) -> None:
        self.cursor = cursor

    def decode(self, sse: ServerSentEvent) -> Event | None:
        if not sse.event and not sse.data:
            return None
        event_id = int(sse.id) if sse.id.isdigit() else None
        if event_id is not None and event_id > self.cursor:
            self.cursor = event_id
        else:
            event_id = None
        kind = EVENT_TYPES.get(sse.event)
        data: Any = msgspec.json.decode(sse.data, type=kind) if kind else msgspec.json.decode(sse.data or "null")
        return Event(sse.event or "message", data, event_id)


def checked_event(decoder: EventDecoder, sse: ServerSentEvent) -> Event | None:
    """The event of a parsed SSE message, None for a comment; raises ``StreamError`` for an ``error``
    event (the stream cannot continue)."""
    event = decoder.decode(sse)
    if event is not None and event.name == wire.ERROR and isinstance(event.data, wire.ErrorEventData):
        raise StreamError(event.data.error)
    return event


RESUMABLE_STATUSES = frozenset({502, 503, 504})


@dataclass
class Reconnects:
    """When to reconnect a task's event stream: after a dropped connection, a stream that ended
    before its final event, an ``error`` event (the service lost its store for a moment) or a
    502/503/504. Delays double from ``first_delay`` up to ``max_delay``; ``limit`` failures in a
    row without a new event give up."""

    limit: int = 8
    first_delay: float = 0.1
    max_delay: float = 5.0
    total: int = 0
    _failures: int = 0

    def progressed(self) -> None:
        self._failures = 0

    def next_delay(self) -> float | None:
        """Delay before the next attempt, or None to give up."""
        self._failures += 1
        self.total += 1
        if self._failures > self.limit:
            return None
        return min(self.max_delay, self.first_delay * 2.0 ** (self._failures - 1))


def resume_headers(cursor: int) -> dict[str, str]:
    return {"Last-Event-ID": str(cursor)} if cursor else {}


def queue_params(queue_events: bool) -> dict[str, str]:
    """Query parameters of a task's event stream: ``queue_events`` asks for ``task.queued`` events
    (the service otherwise tells the queue position in comments, which SSE parsers drop)."""
    return {"queue_events": "true"} if queue_events else {}


def decode(body: bytes, kind: type[Any]) -> Any:
    return msgspec.json.decode(body, type=kind)


class Retry(Exception):
    """A 502/503/504 on (re)connecting a task's events: try again after the delay."""


def connect_error(error: APIStatusError) -> Exception:
    """What a failed (re)connection raises: ``Retry`` for transient statuses, else the error."""
    if error.status in RESUMABLE_STATUSES:
        retry = Retry(str(error))
        retry.__cause__ = error
        return retry
    return error
