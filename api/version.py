"""Protocol versioning: ``LMSP-Version: 1.0`` is accepted (absent means 1.0), any other version gets
``400 unsupported_version``; every response carries ``LMSP-Version: 1.0``."""

from litestar.datastructures import MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from lmsp_core.errors import InvalidRequest

HEADER = "LMSP-Version"
VERSION = "1.0"
SUPPORTED = frozenset({"1.0"})


class VersionMiddleware(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableScopeHeaders.from_message(message)[HEADER] = VERSION
            await send(message)

        requested = next((value.decode().strip() for name, value in scope["headers"]
                          if name.decode().lower() == HEADER.lower()), None)
        if requested is not None and requested not in SUPPORTED:
            raise InvalidRequest(f"LMSP-Version {requested!r} is not supported; this service speaks {VERSION}.",
                                 code="unsupported_version")
        await next_app(scope, receive, send_with_version)
