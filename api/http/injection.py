"""Dependencies injected into route handlers."""

from typing import Any

from litestar import Request
from litestar.datastructures import State

from api.process import Services
from lmsp_core.store.tenants.credentials import Identity


def provide_services(state: State) -> Services:
    services: Services = state.services
    return services


def provide_identity(request: Request[Any, Any, Any]) -> Identity:
    """Who the request acts for, set by the ``api.http.auth.authorize`` guard."""
    identity: Identity = request.state.identity
    return identity


def provide_owner(request: Request[Any, Any, Any]) -> str:
    """The principal that owns what a request creates, and the only one that may see it."""
    return provide_identity(request).principal
