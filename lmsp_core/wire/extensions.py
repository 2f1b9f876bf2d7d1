"""Request extensions (6.1 ``extensions``) on the wire: the names this service knows, their values'
types, and ``Extensions``, the typed Struct a request's known extensions decode into, once
(``ResponseRequest.known_extensions``).

Names carry the ``x-`` prefix of private extensions, so that no later LMSP field or registered
extension name can mean something else. Unknown names are ignored and reported to the client
(``LMSP-Ignored-Extensions``, ``lmsp_core.requests.extensions``); a known name with a bad value is
``400 invalid_extension``. See docs/protocol.md, "Extensions".
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from lmsp_core.wire.errors import InvalidRequest

# the names' size bounds the LMSP-Ignored-Extensions header that reports unknown ones
ExtensionName = Annotated[str, Meta(min_length=1, max_length=128)]
ExtensionMap = Annotated[dict[ExtensionName, Any], Meta(max_length=64)]

SEED = "x-seed"
TOP_P = "x-top_p"
STOP = "x-stop"
PRIORITY = "x-priority"
REASONING_BUDGET = "x-reasoning_budget"
PARALLEL_TOOL_CALLS = "x-parallel_tool_calls"
METADATA = "x-metadata"
PROMPT_CACHE_KEY = "x-prompt_cache_key"
LOGPROBS = "x-logprobs"  # the most likely tokens to report beside each generated one (docs/protocol.md)
MAX_TOP_LOGPROBS = 20

MAX_STOPS = 4
MAX_STOP_LENGTH = 64
# OpenAI's limits for metadata and prompt_cache_key, so that a request passes here where it passes there
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_PROMPT_CACHE_KEY = 64

Priority = Literal["high", "normal", "low"]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LENGTH)]
Metadata = Annotated[dict[Annotated[str, Meta(max_length=MAX_METADATA_KEY)],
                          Annotated[str, Meta(max_length=MAX_METADATA_VALUE)]], Meta(max_length=MAX_METADATA_PAIRS)]

_TYPES: dict[str, Any] = {
    SEED: Annotated[int, Meta(ge=0, le=2**63 - 1)],
    TOP_P: Annotated[float, Meta(gt=0.0, le=1.0)],
    STOP: StopString | Annotated[list[StopString], Meta(min_length=1, max_length=MAX_STOPS)],
    PRIORITY: Priority,
    REASONING_BUDGET: Annotated[int, Meta(ge=0)],
    PARALLEL_TOOL_CALLS: bool,
    METADATA: Metadata,
    PROMPT_CACHE_KEY: Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT_CACHE_KEY)],
    LOGPROBS: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)],
}
_FIELDS = {SEED: "seed", TOP_P: "top_p", STOP: "stop", PRIORITY: "priority", REASONING_BUDGET: "reasoning_budget",
           PARALLEL_TOOL_CALLS: "parallel_tool_calls", METADATA: "metadata", PROMPT_CACHE_KEY: "prompt_cache_key",
           LOGPROBS: "logprobs"}
KNOWN = frozenset(_TYPES)


class Extensions(msgspec.Struct, frozen=True, kw_only=True):
    """The known extensions of one request; None (or empty) where the request does not set them."""

    seed: int | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    priority: Priority | None = None
    reasoning_budget: int | None = None
    parallel_tool_calls: bool = False  # one function call per response unless asked (docs/protocol.md)
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # narrows the prompt prefixes a request may reuse
    logprobs: int | None = None


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a request's ``extensions``: any names, and for the known ones their values."""
    schema: dict[str, Any] = msgspec.json.schema(ExtensionMap)
    schema["properties"] = {name: msgspec.json.schema(kind) for name, kind in _TYPES.items()}
    return schema


def parse(raw: dict[str, Any] | None) -> Extensions:
    """The known extensions of ``raw``; raises ``InvalidRequest`` for a bad value of a known one."""
    values: dict[str, Any] = {}
    for name, value in (raw or {}).items():
        if name not in _TYPES:
            continue
        try:
            converted = msgspec.convert(value, _TYPES[name])
        except msgspec.ValidationError as exc:
            error = {"message": str(exc), "key": f"extensions.{name}", "source": "body"}
            raise InvalidRequest(f"Extension {name!r}: {exc}", code="invalid_extension",
                                 extra={"errors": [error]}) from None
        if name == STOP:
            converted = (converted,) if isinstance(converted, str) else tuple(converted)
        values[_FIELDS[name]] = converted
    return Extensions(**values)
