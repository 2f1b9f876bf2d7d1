"""A lean SSE client on raw asyncio sockets, so that the benchmark measures the service, not httpx.

It speaks just enough HTTP/1.1 for our API: one request per connection, a chunked (or
connection-delimited) response body, events separated by blank lines. Each batch of events is
yielded with the time its bytes arrived.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass


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

    async def batches(self) -> AsyncIterator[tuple[float, list[SseEvent]]]:
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
