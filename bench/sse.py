"""A lean SSE client on raw asyncio sockets, so that the benchmark measures the service, not httpx.

It speaks just enough HTTP/1.1 for our API: one request per connection, a chunked (or
connection-delimited) response body, events separated by blank lines. Each batch of events is
yielded with the time its bytes arrived. ``stream_response`` streams one response of the API through it,
``concurrent_streams`` many at once (the benchmark's sections share them).
"""

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from bench.report import prompt_text, user_input
from lmsp_core import wire

HOST = "127.0.0.1"


@dataclass(frozen=True)
class SseEvent:
    id: int | None
    name: str
    data: str


class HttpError(Exception):
    pass


def parse_block(block: str) -> SseEvent | None:
    event_id, name, data = None, "message", []
    for line in block.split("\n"):
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "id":
            event_id = int(value)
        elif field == "event":
            name = value
        elif field == "data":
            data.append(value)
    if not data and event_id is None:
        return None  # a comment (heartbeat)
    return SseEvent(event_id, name, "\n".join(data))


class SseStream:
    """One request whose response is an event stream."""

    def __init__(self, host: str, port: int, method: str, path: str, body: bytes = b"",
                 headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        self.request = self._request(method, path, body, headers or {})
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def _request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: text/event-stream",
                 "Connection: close"]
        if body:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def open(self) -> None:
        """Connect, send the request and read the response head."""
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            body = await self.reader.read(4096)
            self.close()
            raise HttpError(f"HTTP {status}: {body[:500]!r}")
        self._chunked = b"transfer-encoding: chunked" in head.lower()

    async def _body_parts(self) -> AsyncIterator[bytes]:
        assert self.reader is not None
        while True:
            if self._chunked:
                size = int((await self.reader.readline()).strip() or b"0", 16)
                if size == 0:
                    return
                part = await self.reader.readexactly(size + 2)
                yield part[:-2]
            else:
                part = await self.reader.read(65536)
                if not part:
                    return
                yield part

    async def batches(self) -> AsyncGenerator[tuple[float, list[SseEvent]], None]:
        """(arrival time, events) until the server ends the stream."""
        if self.reader is None:
            await self.open()
        pending = ""
        try:
            async for part in self._body_parts():
                arrived = time.perf_counter()
                pending += part.decode()
                *blocks, pending = pending.replace("\r\n", "\n").split("\n\n")
                events = [event for block in blocks if (event := parse_block(block)) is not None]
                if events:
                    yield arrived, events
        finally:
            self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class EventIdReader(asyncio.Protocol):
    """A follower as cheap as a client can be (a protocol, no coroutine per read): it records when
    each event id arrived, so that a thousand of them in one process measure the server, not
    themselves. Expects a chunked ``200`` event stream."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.arrivals: dict[int, float] = {}
        self.ids: list[int] = []
        self.ready = asyncio.get_running_loop().create_future()
        self.done = asyncio.get_running_loop().create_future()
        self._raw = b""
        self._head = True
        self._events = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        arrived = time.perf_counter()
        self._raw += data
        if self._head:
            head, found, rest = self._raw.partition(b"\r\n\r\n")
            if not found:
                return
            if not head.startswith(b"HTTP/1.1 200"):
                self._finish(HttpError(head[:100].decode(errors="replace")))
                return
            self._head, self._raw = False, rest
        self._dechunk()
        *blocks, self._events = self._events.split(b"\n\n")
        for block in blocks:
            if block.startswith(b"id: "):
                event_id = int(block[4:block.index(b"\n")])
                self.ids.append(event_id)
                self.arrivals[event_id] = arrived
            if not self.ready.done():
                self.ready.set_result(None)

    def _dechunk(self) -> None:
        while True:
            size_end = self._raw.find(b"\r\n")
            if size_end < 0:
                return
            size = int(self._raw[:size_end], 16)
            if size == 0:
                self._finish(None)
                return
            end = size_end + 2 + size + 2
            if len(self._raw) < end:
                return
            self._events += self._raw[size_end + 2:end - 2]
            self._raw = self._raw[end:]

    def _finish(self, error: Exception | None) -> None:
        for future in (self.ready, self.done):
            if not future.done():
                future.set_result(None) if error is None else future.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc)


@dataclass
class StreamResult:
    """One streamed response of the API: seconds to its first text, in all, tokens, gapless event ids."""

    ttft: float
    seconds: float
    tokens: int
    gapless: bool


async def stream_response(port: int, model: str, text: str, max_tokens: int) -> StreamResult:
    """``text`` as a user message to ``/lmsp/v1/responses`` on ``port``, streamed, greedy."""
    body = json.dumps({"model": model, "input": user_input(text), "stream": True, "max_output_tokens": max_tokens,
                       "temperature": 0}).encode()
    stream = SseStream(HOST, port, "POST", "/lmsp/v1/responses", body)
    start = time.perf_counter()
    first = 0.0
    ids: list[int] = []
    tokens = 0
    async for arrived, events in stream.batches():
        for event in events:
            if event.id is not None:
                ids.append(event.id)
            if event.name == wire.TEXT_DELTA and not first:
                first = arrived
            if event.name in wire.FINAL_EVENTS:
                tokens = json.loads(event.data).get("usage", {}).get("output_tokens", 0)
                first = first or arrived  # no text at all (the first token ended it)
    end = time.perf_counter()
    return StreamResult(first - start, end - start, tokens, ids == list(range(1, len(ids) + 1)))


async def concurrent_streams(port: int, model: str, count: int, max_tokens: int) -> tuple[int, float, bool]:
    """``count`` responses streamed at once: (tokens in all, seconds, whether every one was gapless)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_response(port, model, prompt_text(i), max_tokens) for i in range(count)))
    seconds = time.perf_counter() - start
    return sum(r.tokens for r in results), seconds, all(r.gapless for r in results)
