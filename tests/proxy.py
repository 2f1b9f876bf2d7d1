"""A TCP proxy for tests that cuts connections mid-stream, as a flaky network would.

It runs its own event loop in a thread, so that blocking clients (the sync client, a browser)
and asyncio tests can both use it. A connection whose request contains ``match`` is closed after
``cut_after`` bytes of the answer have gone back to the client; others are forwarded untouched.
"""

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any

from tests.support import free_port


class CuttingProxy:
    def __init__(self, target_port: int, *, cut_after: int | None, match: bytes = b"/events") -> None:
        self.target_port = target_port
        self.cut_after = cut_after
        self.match = match
        self.port = free_port()
        self.cuts = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cutting-proxy")
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "CuttingProxy":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port, family=socket.AF_INET))
        self._ready.set()
        self._loop.run_forever()
        shut_down(self._loop, self._server)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writers = [client_writer]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            writers.append(upstream_writer)
            state = _Connection()
            await relay(self._requests(client_reader, upstream_writer, state),
                        self._answers(upstream_reader, client_writer, state))
        except OSError:
            pass  # nothing upstream: the client sees its connection closed
        finally:
            await close_all(writers)

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: "_Connection") -> None:
        while chunk := await reader.read(65536):
            # a kept-alive connection may carry other requests first: arm at the matching one
            if self.cut_after is not None and state.budget is None and self.match in chunk:
                state.budget = self.cut_after
            writer.write(chunk)
            await writer.drain()

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: "_Connection") -> None:
        while chunk := await reader.read(4096):
            if state.budget is not None and len(chunk) >= state.budget:
                writer.write(chunk[: state.budget])
                await writer.drain()
                self.cuts += 1
                return  # the caller closes both sides: the client sees a connection cut mid-body
            if state.budget is not None:
                state.budget -= len(chunk)
            writer.write(chunk)
            await writer.drain()


class _Connection:
    def __init__(self) -> None:
        self.budget: int | None = None  # answer bytes left before the cut, once armed


async def relay(*pipes: Coroutine[Any, Any, None]) -> None:
    """Run the directions of a proxied connection until one ends, then stop the others."""
    tasks = [asyncio.ensure_future(pipe) for pipe in pipes]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(writers: list[asyncio.StreamWriter]) -> None:
    """Close a connection's streams, also when its handler was cancelled: a stream left open warns
    (ResourceWarning, an error in the tests) when it is collected after its loop has closed."""
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def shut_down(loop: asyncio.AbstractEventLoop, server: asyncio.Server) -> None:
    """After ``run_forever``: stop listening, let the handlers of connections accepted meanwhile
    start (one cancelled before its first step would never close its streams), cancel every
    handler, wait for their clean-up, close the loop."""
    server.close()
    loop.run_until_complete(asyncio.sleep(0))
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(server.wait_closed())
    loop.run_until_complete(asyncio.sleep(0.05))  # let closed transports release their sockets
    loop.close()
