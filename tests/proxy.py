"""A TCP proxy for tests that cuts connections mid-stream, as a flaky network would.

It runs its own event loop in a thread, so that blocking clients (the sync client, a browser)
and asyncio tests can both use it. A connection whose request contains ``match`` is closed after
``cut_after`` bytes of the answer have gone back to the client; others are forwarded untouched.
"""

import asyncio
import contextlib
import socket
import threading

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
        self._server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.run_until_complete(asyncio.sleep(0.05))  # let closed transports release their sockets
        self._loop.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            await client_writer.wait_closed()
            return
        state = _Connection()
        upstream = asyncio.ensure_future(self._requests(client_reader, upstream_writer, state))
        downstream = asyncio.ensure_future(self._answers(upstream_reader, client_writer, state))
        try:
            await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (upstream, downstream):
                task.cancel()
            await asyncio.gather(upstream, downstream, return_exceptions=True)
            for writer in (client_writer, upstream_writer):
                writer.close()
            for writer in (client_writer, upstream_writer):
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

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
