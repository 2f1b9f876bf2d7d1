"""Protocol versioning: ``LMSP-Version: 1.0`` is accepted (absent means 1.0), any other version gets
``400 unsupported_version``; every response carries ``LMSP-Version: 1.0``. The OpenAI routes under
``/v1`` do not speak LMSP: the header is not checked there."""

import msgspec
from litestar.datastructures import MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.openai import is_openai_path
from lmsp_core.wire.errors import PROBLEM_MEDIA_TYPE, InvalidRequest

HEADER = "LMSP-Version"
VERSION = "1.0"
SUPPORTED = frozenset({"1.0"})


async def add_version_header(message: Message, scope: Scope) -> None:
    """App-wide ``before_send`` hook: also covers errors raised before routing (404, 405)."""
    if message["type"] == "http.response.start":
        MutableScopeHeaders.from_message(message)[HEADER] = VERSION


class VersionMiddleware(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        requested = next((value.decode().strip() for name, value in scope["headers"]
                          if name.decode().lower() == HEADER.lower()), None)
        if requested is not None and requested not in SUPPORTED and not is_openai_path(scope["path"]):
            error = InvalidRequest(f"LMSP-Version {requested!r} is not supported; this service speaks {VERSION}.",
                                   code="unsupported_version")
            refusal = ASGIResponse(body=msgspec.json.encode(error.problem()), status_code=error.status,
                                   media_type=PROBLEM_MEDIA_TYPE)
            await refusal(scope, receive, send)
            return
        await next_app(scope, receive, send)
