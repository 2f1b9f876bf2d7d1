"""Authentication and authorisation: who a request acts for and what it may do.

Every route declares what it needs in its ``opt``: ``{"scope": "tasks:read"}`` or ``{"public": True}``
(probes, the OpenAPI schema). One app-wide guard authenticates the bearer token, applies the
principal's rate limit and checks the scope; ``check_routes`` refuses to build an app in which a
route declares neither, so a new route cannot be open by accident.

``LMSP_AUTH=none`` turns authentication off for local use: every request acts for the fixed
principal ``local`` with every grantable scope. It is accepted only when the API binds a loopback
address (``check_exposure``).
"""

import logging
from typing import Any

from litestar import Litestar
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.routes import HTTPRoute, WebSocketRoute

from api.process import Services
from lmsp_core.settings import Settings
from lmsp_core.store.tenants import credentials
from lmsp_core.store.tenants.credentials import Identity
from lmsp_core.wire.errors import Forbidden, Unauthorized

logger = logging.getLogger(__name__)

LOCAL = Identity("local", frozenset(credentials.GRANTABLE))
# a WebSocket route that calls ``authorized`` itself at its handshake, so that a refusal is an HTTP
# answer with its status rather than a closed socket (its ``opt`` names its scope all the same)
HANDSHAKE = "handshake"


class OpenOnNetwork(SystemExit):
    """Raised at start-up: ``LMSP_AUTH=none`` on an address other hosts can reach."""


def check_exposure(settings: Settings) -> None:
    if settings.auth != "none":
        return
    if not settings.host_is_loopback:
        raise OpenOnNetwork(f"refusing to start: LMSP_AUTH=none on {settings.host}, which is not a loopback "
                            "address; use LMSP_AUTH=tokens (and `lmsp token create`) or bind 127.0.0.1")
    logger.warning("authentication is off (LMSP_AUTH=none): every request acts for principal %r; "
                   "listening on loopback %s only", LOCAL.principal, settings.host)


def check_routes(app: Litestar) -> None:
    """Every route handler must declare a scope or be public."""
    for route in app.routes:
        if isinstance(route, WebSocketRoute) and route.route_handler.opt.get("scope") not in credentials.GRANTABLE:
            raise RuntimeError(f"WebSocket route {route.path} declares no scope: give it opt={{'scope': ...}}")
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            if handler.http_methods == {"OPTIONS"}:
                continue  # Litestar's automatic OPTIONS answers (CORS preflight), no data
            if not handler.opt.get("public") and handler.opt.get("scope") not in credentials.GRANTABLE:
                raise RuntimeError(f"route {sorted(handler.http_methods)} {route.path} declares no scope: "
                                   "give it opt={'scope': ...} or opt={'public': True}")


async def authorize(connection: ASGIConnection[BaseRouteHandler, Any, Any, Any],
                    handler: BaseRouteHandler) -> None:
    """The app-wide guard: authenticate, count the request against the rate limit, check the scope."""
    if handler.opt.get("public") or handler.opt.get(HANDSHAKE):
        return
    services: Services = connection.app.state.services
    connection.state.identity = await authorized(services, connection.headers.get("authorization"),
                                                 str(handler.opt.get("scope")))


async def authorized(services: Services, header: str | None, scope: str) -> Identity:
    """Who ``header`` (an ``Authorization`` value) acts for, counted against its rate limit, if it
    has ``scope``."""
    identity = await authenticate(services, header)
    await services.limits.count_request(identity.principal)
    if scope not in identity.scopes:
        raise Forbidden(f"This operation needs the {scope!r} scope, which the token does not have.", scope=scope)
    return identity


async def authenticate(services: Services, header: str | None) -> Identity:
    if services.settings.auth == "none":
        return LOCAL  # an Authorization header, if any, is ignored
    if header is None:
        raise Unauthorized("This operation needs a bearer token: Authorization: Bearer <token>.")
    scheme, _, token = header.partition(" ")
    identity = None
    if scheme.lower() == "bearer" and token.strip():
        identity = await credentials.authenticate(services.redis, token.strip())
    if identity is None:
        logger.info("rejected a request with an invalid or revoked token")  # never the token itself
        raise Unauthorized("The bearer token is not valid.", code="invalid_token")
    return identity
