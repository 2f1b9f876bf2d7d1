"""A webhook receiver: an HTTP server in a thread of the test process."""

import http.server
import threading
import time
from typing import Any

import msgspec

from tests.support.waiting import wait_for


class Received(msgspec.Struct, frozen=True):
    """One request a ``Receiver`` got: its path, headers (lower-case names) and body."""

    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    """A webhook receiver: an HTTP server in a thread of the test process that keeps every POST and
    answers each with the next of ``answers`` (200 once they run out), after ``delay`` seconds."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.answers: list[int] = []
        self.delay = 0.0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                time.sleep(receiver.delay)
                status = receiver.answers.pop(0) if receiver.answers else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        """The first ``count`` requests, once there are as many."""
        await wait_for(lambda: _now(len(self.received) >= count), timeout, f"{count} webhook requests")
        return self.received[:count]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def _now(value: Any) -> Any:
    return value
