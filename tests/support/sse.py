"""Server-sent events as a test reads them (httpx-sse, heartbeats skipped), and the checks of a
task's event log."""

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import httpx
import msgspec
from httpx_sse import aconnect_sse

from lmsp_core import wire


class SseEvent(msgspec.Struct):
    id: int | None
    event: str
    data: dict[str, Any]


async def sse_events(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> AsyncIterator[SseEvent]:
    async with aconnect_sse(client, method, url, **kwargs) as source:
        source.response.raise_for_status()
        async with aclosing(source.aiter_sse()) as sses:
            async for sse in sses:
                if not sse.data:
                    continue  # a comment (heartbeat)
                yield SseEvent(int(sse.id) if sse.id else None, sse.event, msgspec.json.decode(sse.data))


async def collect(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> list[SseEvent]:
    return [event async for event in sse_events(client, method, url, **kwargs)]


def logged(received: list[SseEvent]) -> list[SseEvent]:
    """The events of the task's log (without the id-less queue notices a client may ask for)."""
    return [e for e in received if e.event != wire.QUEUED]


def assert_complete_log(log: list[SseEvent], start: int = 1) -> None:
    assert [e.id for e in log] == list(range(start, start + len(log)))
    assert [e.event for e in log].count(wire.COMPLETED) + [e.event for e in log].count(wire.INCOMPLETE) == 1
    assert log[-1].event in wire.FINAL_EVENTS
