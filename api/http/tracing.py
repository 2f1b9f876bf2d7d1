"""A request's place in its client's trace (W3C ``traceparent``): see ``lmsp_core.tracing``.

With tracing on, every routed request is a server span, child of the client's ``traceparent`` where
it sent a valid one, that lasts as long as its response (a stream's included); a task the request
creates stores the span's context. With tracing off nothing is recorded, but a valid
``traceparent`` is still what the task stores, so that workers which trace join the client's trace.
"""

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from lmsp_core import tracing

_HEADER = tracing.TRACEPARENT.encode()


class TracingMiddleware(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        parent = tracing.parse_traceparent(next((value.decode("latin-1") for name, value in scope["headers"]
                                                 if name.lower() == _HEADER), None))
        if not tracing.enabled():
            if parent is None:
                await next_app(scope, receive, send)
                return
            with tracing.active(tracing.Span(parent)):
                await next_app(scope, receive, send)
            return
        await _traced(scope, receive, send, next_app, parent)


async def _traced(scope: Scope, receive: Receive, send: Send, next_app: ASGIApp, parent: str | None) -> None:
    method = str(scope.get("method", "GET"))
    route = str(scope.get("path_template") or scope["path"])
    span = tracing.start(f"{method} {route}", parent, kind="server", attributes={
        "http.request.method": method, "http.route": route, "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http")})

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            status = int(message["status"])
            span.set({"http.response.status_code": status})
            if status >= 500:
                span.fail(f"status {status}")
        await send(message)

    try:
        with tracing.active(span):
            await next_app(scope, receive, sending)
    finally:
        span.end()
