"""Following responses over a WebSocket: OpenAI's WebSocket mode of ``/v1/responses``
(``api.openai.websocket`` says what its messages mean; ``api.http.routes.openai_responses_socket``
opens the connection).

Each ``response.create`` becomes a direct task as ``POST /v1/responses`` with ``stream: true``
makes one (``streams.open``: the principal's stream slot first, then submit), followed from the
task's Redis stream by the one loop that follows tasks (``streams.follow``); each of its events goes
out as a message of its own, the JSON that the SSE stream carries in its ``data`` lines. Creates are
answered one after another, in the order they arrive. A client that leaves mid-response cancels a
``store: false`` response, which nobody could read again; a stored one runs on, and is resumed by id
(``GET /v1/responses/{id}?stream=true``). A message the service refuses gets an error envelope and
the connection goes on.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any, cast

import msgspec
from litestar import WebSocket
from litestar.exceptions import WebSocketDisconnect
from redis.exceptions import RedisError

from api.follow import streams
from api.follow.framing import KEEPALIVE, ResponseFrames
from api.limits import StreamSlot
from api.openai import objects as oa
from api.openai.conversations import turn_of
from api.openai.errors import with_param
from api.openai.rendering import ResponseView
from api.openai.translation import RESPONSES_PARAMS, responses_request
from api.openai.websocket import ConnectionCache, decode_create, envelope, stream_id_of
from api.process import Services
from lmsp_core import wire
from lmsp_core.store.objects.conversations import context
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.store.tenants.credentials import Identity
from lmsp_core.wire.errors import LmspError, ServiceUnavailable

logger = logging.getLogger(__name__)

INBOX = 16  # creates read ahead of the one being answered; beyond, the client's sends wait
_EXPIRED = "The events of this response have expired."  # (a create is never an idempotent repeat)


class SocketFrames(ResponseFrames):
    """A response's events as WebSocket messages: a line each (our JSON never holds a raw line
    break), with the create's ``stream_id`` added to each."""

    def __init__(self, view: ResponseView, stream_id: str | None) -> None:
        super().__init__(view)
        self.tail = b"}" if stream_id is None else b',"stream_id":' + msgspec.json.encode(stream_id) + b"}"

    def encode(self, events: list[oa.StreamEvent]) -> bytes:
        return b"".join(oa.encoder.encode(event)[:-1] + self.tail + b"\n" for event in events)


async def serve(services: Services, socket: WebSocket[Any, Any, Any], identity: Identity) -> None:
    """Answer the connection's messages, one after another, until the client leaves."""
    inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue(INBOX)
    reader = asyncio.create_task(_read(socket, inbox), name="socket-reader")
    session = _Session(services, socket, identity, reader)
    try:
        while (message := await inbox.get()) is not None:
            if not await session.answer(message):
                break
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _read(socket: WebSocket[Any, Any, Any], inbox: asyncio.Queue[str | bytes | None]) -> None:
    """Queue the client's messages; ``None`` once it is gone (this task ends then, and only then)."""
    try:
        while True:
            message = await socket.receive()
            if message["type"] != "websocket.receive":
                break
            text = message.get("text")
            await inbox.put(text if text is not None else message.get("bytes") or b"")
    except WebSocketDisconnect:
        pass
    finally:
        while not inbox.empty():  # creates of a client that left are not answered
            inbox.get_nowait()
        inbox.put_nowait(None)


class _Session:
    def __init__(self, services: Services, socket: WebSocket[Any, Any, Any], identity: Identity,
                 reader: asyncio.Task[None]) -> None:
        self.services = services
        self.socket = socket
        self.owner = identity.principal
        self.reader = reader
        self.cache = ConnectionCache()

    async def answer(self, raw: str | bytes) -> bool:
        """Answer one message; False once the client is gone."""
        try:
            create = decode_create(raw)
            await self.services.limits.count_request(self.owner)
            request = responses_request(create.body, self.services.catalog.get(create.body.model))
            if request.previous_response_id in self.cache:
                request = self.cache.continued(request)
            record, _, slot = await streams.open(self.services, request, kind="direct", owner=self.owner,
                                                 stream=True, expired=_EXPIRED,
                                                 history=turn_of(self.services.conversation_objects, request,
                                                                 self.owner))
        except LmspError as exc:
            return await self._send(envelope(with_param(exc, RESPONSES_PARAMS), stream_id_of(raw)))
        except RedisError:
            unreachable = ServiceUnavailable("The service's store is unreachable; retry shortly.")
            return await self._send(envelope(unreachable, stream_id_of(raw)))
        except Exception:  # a bug must not end the client's connection: it gets a 500 envelope
            logger.exception("answering a response.create failed")
            return await self._send(envelope(LmspError("The service failed to answer this message."),
                                             stream_id_of(raw)))
        assert slot is not None
        frames = SocketFrames(ResponseView(record), create.stream_id)
        if not await self._follow(record, slot, frames, cancel=not request.store):
            return False
        await self._remember(record, request)
        return True

    async def _follow(self, record: TaskRecord, slot: StreamSlot, frames: SocketFrames, *, cancel: bool) -> bool:
        """Send the task's events until its final one; False if the client left first."""
        forwarding = asyncio.create_task(self._forward(record, slot, frames, cancel=cancel))
        await asyncio.wait({forwarding, self.reader}, return_when=asyncio.FIRST_COMPLETED)
        if not forwarding.done():  # the client left
            forwarding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await forwarding
            return False
        return forwarding.result()

    async def _forward(self, record: TaskRecord, slot: StreamSlot, frames: SocketFrames, *, cancel: bool) -> bool:
        # closed here rather than when collected: a client gone mid-response cancels its task now
        chunks = cast(AsyncGenerator[bytes, None], streams.follow(self.services, record, frames, cancel=cancel))
        try:
            async for chunk in chunks:
                if chunk != KEEPALIVE:
                    for line in chunk.splitlines():
                        await self.socket.send_data(line)
        except (WebSocketDisconnect, OSError):
            return False
        finally:
            await chunks.aclose()
            await slot.release()
        return True

    async def _remember(self, record: TaskRecord, request: wire.ResponseRequest) -> None:
        """Keep a ``store: false`` response that ended with output, for ``previous_response_id``."""
        if request.store:
            return
        try:
            final = await self.services.store.get(record.id)
            response = final.response_object() if final is not None else None
            if response is None or response.status not in ("completed", "incomplete"):
                return
            earlier: list[wire.InputItem] = []
            if request.previous_response_id is not None:  # a stored conversation's continuation
                earlier = context(await self.services.conversations.chain(request.previous_response_id, self.owner),
                                  [])
        except (LmspError, RedisError):
            return  # not continuable: a later create that names it is told so
        self.cache.keep(record.response_id, request, earlier, response)

    async def _send(self, message: bytes) -> bool:
        try:
            await self.socket.send_data(message)
        except (WebSocketDisconnect, OSError):
            return False
        return True

