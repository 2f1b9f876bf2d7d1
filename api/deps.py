"""Dependencies injected into route handlers."""

from litestar.datastructures import State

from api.services import Services

ANONYMOUS = "local"


def provide_services(state: State) -> Services:
    services: Services = state.services
    return services


def provide_owner() -> str:
    """The principal that owns what a request creates."""
    return ANONYMOUS
