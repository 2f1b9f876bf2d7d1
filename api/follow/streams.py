"""Following a task, for every route that does: the one owner of a client's time with a task.

A streamed answer takes its principal's stream slot first, so that a refused stream leaves no task
behind (``open``); a streaming repeat of an idempotent request replays the task's events from the
start, so they must still exist (``check_history``). The stream itself is one loop for every kind
(``follow``): the events come from the process's hub (``api.eventhub``), a framer of
``api.follow.framing`` turns them into bytes, a keep-alive goes out whenever the hub has nothing.

A direct response (``POST /lmsp/v1/responses`` and the OpenAI routes without ``background``) is a
task whose lifetime is its HTTP connection: a client that goes away before the final event cancels
its task, unless it sent an ``Idempotency-Key`` (it said it will repeat the request). A stream the
service ends itself, at the final event or with the error frame of a lost store, cancels nothing.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

import anyio
from litestar.response import Stream
from litestar.types import Receive
from redis.exceptions import RedisError

from api.follow.framing import KEEPALIVE, response
from api.limits import StreamSlot
from api.process import Services
from api.submission.submit import History, submit
from lmsp_core import wire
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.eventlog import Event
from lmsp_core.store.tasks.records import Kind, TaskRecord
from lmsp_core.wire.errors import Gone


class Framer(Protocol):
    """What a kind of stream sends (``api.follow.framing``)."""

    async def opening(self) -> bytes: ...  # before the first event

    def events(self, batch: list[Event]) -> bytes: ...

    async def idle(self) -> bytes: ...  # after a keep-alive

    def end(self) -> bytes: ...  # after the final event

    def lost(self) -> bytes: ...  # the store became unreachable


class Opened(NamedTuple):
    record: TaskRecord
    repeated: bool  # an idempotent repeat: the task of an earlier request
    slot: StreamSlot | None  # the stream's slot; None for an answer that is not streamed


async def open(services: Services, request: wire.ResponseRequest, *, kind: Kind, owner: str, stream: bool,
               expired: str, idempotency_key: str | None = None, endpoint: str | None = None,
               history: History | None = None) -> Opened:
    """Submit the request (``api.submission.submit``), with the stream's slot taken first when
    ``stream``; ``expired`` is the ``410`` of a streaming repeat whose events are gone."""
    slot = await services.limits.open_stream(owner) if stream else None
    try:
        record, repeated = await submit(services, request, kind=kind, owner=owner, idempotency_key=idempotency_key,
                                        endpoint=endpoint, history=history)
        if slot is not None and repeated:
            await check_history(services, record, expired)
    except BaseException:
        if slot is not None:
            await slot.release()
        raise
    return Opened(record, repeated, slot)


async def check_history(services: Services, record: TaskRecord, expired: str) -> None:
    """``410 event_history_expired`` (``expired``) for a final task whose events are gone."""
    if record.final and not await eventlog.history_exists(services.redis, record.id):
        raise Gone(expired)


def stream(services: Services, slot: StreamSlot, record: TaskRecord, framer: Framer, *, after: int = 0,
           cancel: bool = False, headers: dict[str, str] | None = None) -> Stream:
    """The event-stream answer: the task's events after ``after``, framed, holding ``slot`` until it
    ends; with ``cancel``, a client that leaves first cancels the task."""
    return response(slot.wrap(follow(services, record, framer, after, cancel=cancel)), headers)


async def follow(services: Services, record: TaskRecord, framer: Framer, after: int = 0, *,
                 cancel: bool = False) -> AsyncIterator[bytes]:
    """The task's events after ``after`` up to the final one, as ``framer`` frames them."""
    gauge = services.metrics.open_streams.labels(record.kind)
    gauge.inc()
    ended = False
    try:
        if opening := await framer.opening():
            yield opening
        async for batch in services.hub.follow(record, after):
            if batch is None:
                yield KEEPALIVE
                if notice := await framer.idle():
                    yield notice
            elif sent := framer.events(batch):
                yield sent
        ended = True
        if closing := framer.end():
            yield closing
    except (RedisError, OSError):
        ended = True
        yield framer.lost()
    finally:
        gauge.dec()
        if cancel and not ended:  # the client went away
            await cancel_task(services, record)


async def until_final(services: Services, record: TaskRecord) -> None:
    """Return once the task's final event is stored."""
    async for _ in services.hub.follow(record, record.last_event_id):
        pass


async def final_or_disconnect(services: Services, record: TaskRecord, receive: Receive, *, cancel: bool) -> bool:
    """Wait for the task's final event; False if the client disconnects first, which cancels the
    task with ``cancel``."""
    final = asyncio.create_task(until_final(services, record))
    gone = asyncio.create_task(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (final, gone):
            task.cancel()
    if final in done:
        final.result()  # re-raises a Redis failure
        return True
    if cancel:
        await cancel_task(services, record)
    return False


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_task(services: Services, record: TaskRecord) -> None:
    """Cancel a task whose client went away (shielded: it runs while the request is being torn down)."""
    with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
        await services.store.cancel(record)
