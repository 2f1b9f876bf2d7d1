"""What a request's extensions mean for this service beyond their values
(``lmsp_core.wire.extensions``): which names had no effect, and a request's priority.
See docs/protocol.md, "Extensions".
"""

from lmsp_core import wire
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.wire.extensions import KNOWN, REASONING_BUDGET, Priority


def ignored(request: wire.ResponseRequest, spec: ModelSpec) -> list[str]:
    """The extension names of the request that have no effect: unknown names, and a reasoning
    budget for a model without a reasoning format."""
    names = list(request.extensions or ())
    return [name for name in names if name not in KNOWN or (name == REASONING_BUDGET and spec.reasoning is None)]


def priority(request: wire.ResponseRequest, direct: bool) -> Priority:
    """The request's priority: ``x-priority``, else ``high`` for direct responses (someone waits on
    the connection) and ``normal`` for tasks."""
    chosen = request.known_extensions.priority
    return chosen if chosen is not None else ("high" if direct else "normal")
