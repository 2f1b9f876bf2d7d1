"""``ws://HOST/v1/responses``: OpenAI's WebSocket mode of the Responses API (``api.follow.sockets``
answers the connection; ``api.openai.websocket`` says what its messages mean).

The handshake carries the credentials, as an HTTP request to ``/v1/responses`` would (``Authorization:
Bearer``, the ``responses:write`` scope, one request against the rate limit); a refused handshake is
answered with the HTTP status and OpenAI's error object, as the route's POST would be, where the server
can answer a handshake so (else the socket is closed with 1008, policy violation, before it opens).
A handshake from a browser's page (``Origin``) is refused unless CORS allows that origin.
"""

import contextlib
from typing import Any

import msgspec
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect
from litestar.status_codes import WS_1008_POLICY_VIOLATION
from litestar.types import WebSocketResponseBodyEvent, WebSocketResponseStartEvent

from api.follow import sockets
from api.http.auth import HANDSHAKE, authorized
from api.openai import PREFIX
from api.openai.errors import MEDIA_TYPE, error_object
from api.process import Services
from lmsp_core.store.tenants import credentials
from lmsp_core.wire.errors import LmspError

_DENIAL = "websocket.http.response"  # the ASGI extension that answers a handshake with an HTTP response


class OriginNotAllowed(LmspError):
    status = 403
    default_code = "origin_not_allowed"
    title = "Origin not allowed"


@websocket(f"{PREFIX}/responses", opt={"scope": credentials.RESPONSES_WRITE, HANDSHAKE: True})
async def responses_socket(socket: WebSocket[Any, Any, Any], services: Services) -> None:
    try:
        _check_origin(services, socket.headers.get("origin"))
        identity = await authorized(services, socket.headers.get("authorization"), credentials.RESPONSES_WRITE)
    except LmspError as exc:
        await _refuse(socket, exc)
        return
    await socket.accept()
    await sockets.serve(services, socket, identity)
    if socket.connection_state != "disconnect":
        with contextlib.suppress(WebSocketDisconnect, OSError):  # it left while we closed
            await socket.close()


def _check_origin(services: Services, origin: str | None) -> None:
    """A browser's page may open a socket to any address, without CORS's preflight: only the origins
    ``LMSP_CORS_ORIGINS`` lets read HTTP answers may open one (clients other than browsers send no
    ``Origin``)."""
    allowed = services.settings.cors_origin_list
    if origin is not None and origin not in allowed and "*" not in allowed:
        raise OriginNotAllowed(f"Origin {origin!r} may not open a WebSocket here (LMSP_CORS_ORIGINS).")


async def _refuse(socket: WebSocket[Any, Any, Any], exc: LmspError) -> None:
    problem = exc.problem()
    if _DENIAL not in (socket.scope.get("extensions") or {}):
        await socket.close(code=WS_1008_POLICY_VIOLATION, reason=problem.code)
        return
    await socket.receive()  # the handshake's websocket.connect
    headers = [(b"content-type", MEDIA_TYPE.encode()),
               *((name.lower().encode(), value.encode()) for name, value in exc.headers.items())]
    start: WebSocketResponseStartEvent = {"type": "websocket.http.response.start", "status": problem.status,
                                          "headers": headers}
    body: WebSocketResponseBodyEvent = {"type": "websocket.http.response.body", "more_body": False,
                                        "body": msgspec.json.encode(error_object(problem))}
    await socket.send(start)
    await socket.send(body)
