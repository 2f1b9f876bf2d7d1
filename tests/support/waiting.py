"""Waiting for something a real process does: a condition polled, a port that listens."""

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 60, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")
