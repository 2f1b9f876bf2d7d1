"""The event-plane benchmark's followers: SSE clients as cheap as a client can be, which keep the bytes
that arrive with their arrival time and read the events from them afterwards."""

import asyncio

import numpy as np

from bench.simulated import CLOCK
from bench.sse import HOST


class Follower(asyncio.Protocol):
    """An SSE client that only keeps what arrives, with the time it arrived; ``events`` reads it."""

    def __init__(self, task_id: str) -> None:
        self.request = (f"GET /lmsp/v1/tasks/{task_id}/events HTTP/1.1\r\nHost: {HOST}\r\n"
                        "Accept: text/event-stream\r\nConnection: close\r\n\r\n").encode()
        self.arrived: list[tuple[float, bytes]] = []
        self.closed = asyncio.get_running_loop().create_future()
        self.opened = CLOCK()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.opened = CLOCK()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.arrived.append((CLOCK(), data))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def events(self) -> list[tuple[float, int, str, bytes]]:
        """(arrival time, id, name, data) of every event, read from the chunked body."""
        raw = b"".join(data for _, data in self.arrived)
        ends = np.cumsum([len(data) for _, data in self.arrived])
        times = [arrived for arrived, _ in self.arrived]
        body, offsets = _dechunk(raw, raw.index(b"\r\n\r\n") + 4)
        events = []
        start = 0
        while (end := body.find(b"\n\n", start)) >= 0:
            block, start = body[start:end], end + 2
            fields = dict(line.split(b": ", 1) for line in block.split(b"\n") if not line.startswith(b":"))
            if b"id" in fields:
                at = times[int(np.searchsorted(ends, offsets[int(np.searchsorted(offsets[:, 0], end))][1], "right"))]
                events.append((at, int(fields[b"id"]), fields[b"event"].decode(), fields[b"data"]))
        return events


def _dechunk(raw: bytes, position: int) -> tuple[bytes, np.ndarray]:
    """The body of a chunked response, and for each chunk (its end in the body, its end in ``raw``)."""
    parts: list[bytes] = []
    offsets: list[tuple[int, int]] = []
    length = 0
    while True:
        line_end = raw.index(b"\r\n", position)
        size = int(raw[position:line_end], 16)
        if size == 0:
            return b"".join(parts), np.asarray(offsets or [(0, 0)], dtype=np.int64)
        start = line_end + 2
        parts.append(raw[start:start + size])
        length += size
        offsets.append((length, start + size - 1))
        position = start + size + 2
