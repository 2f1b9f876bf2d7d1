"""HTTP connections between requests (docs/protocol.md, "Connections")."""

import asyncio
from urllib.parse import urlsplit

from tests.support import Api

CLIENT_POOL_EXPIRY_S = 5.0  # httpx's, and so the openai SDK's: how long a client reuses an idle connection


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> bytes:
    writer.write(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    await reader.readexactly(length)
    return head


async def test_an_idle_connection_outlives_the_clients_pool_expiry(api: Api) -> None:
    """A client that reuses a connection just before its pool drops it must not find it closing."""
    url = urlsplit(api.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        assert (await _get(reader, writer, url.netloc)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(CLIENT_POOL_EXPIRY_S + 0.5)
        assert (await _get(reader, writer, url.netloc)).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
        await writer.wait_closed()
