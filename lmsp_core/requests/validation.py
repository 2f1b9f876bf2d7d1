"""Checks of a request against the model that is to run it (beyond what decoding validates).

The API runs them before it answers (so errors are HTTP 400s, before any SSE byte); a worker runs
them again before it generates, since a queued request may meet a differently configured worker.
"""

import re
from collections.abc import Sequence

from lmsp_core import wire
from lmsp_core.requests import grammars
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.settings import Settings
from lmsp_core.wire.errors import ContextLengthExceeded, InvalidRequest, LimitExceeded, UnsupportedCapability

_RESERVED_CONTENT = (wire.InputImage, wire.InputAudio, wire.InputFile)


def check_request(request: wire.ResponseRequest, spec: ModelSpec,
                  items: Sequence[wire.InputItem] | None = None) -> None:
    """Raise if the request cannot run on the model. ``items`` is the whole input when it is more than
    the request's own (a conversation continued with previous_response_id)."""
    _check_content(request)
    _check_capabilities(request, spec)
    _check_tools(request)
    _check_calls(request.input if items is None else items)
    _check_response_format(request)
    request.known_extensions  # noqa: B018  (decoding checks the values: 400 invalid_extension)
    if request.max_output_tokens is not None and request.max_output_tokens > spec.max_output_tokens:
        raise InvalidRequest(
            f"max_output_tokens is {request.max_output_tokens}; model {spec.id!r} allows at most "
            f"{spec.max_output_tokens}.",
            code="max_output_tokens_too_large",
        )


def check_limits(request: wire.ResponseRequest, limits: Settings) -> None:
    """The API's admission limits (``LMSP_MAX_INPUT_ITEMS``, ``LMSP_MAX_TOOLS``, ``LMSP_MAX_INPUT_CHARS``)."""
    items = limits.max_input_items
    if len(request.input) > items:
        raise LimitExceeded(f"input has {len(request.input)} items; at most {items} are allowed.",
                            code="too_many_input_items")
    for index, item in enumerate(request.input):
        parts = len(item.content) if isinstance(item, wire.Message) else (
            len(item.summary) if isinstance(item, wire.Reasoning) else 0)
        if parts > items:
            raise LimitExceeded(f"input[{index}] has {parts} parts; at most {items} are allowed.",
                                code="too_many_input_items")
    tools = len(request.tools or ())
    if tools > limits.max_tools:
        raise LimitExceeded(f"The request has {tools} tools; at most {limits.max_tools} are allowed.",
                            code="too_many_tools")
    chars = input_chars(request)
    if chars > limits.max_input_chars:
        raise LimitExceeded(f"The input has {chars} characters of text; at most {limits.max_input_chars} "
                            "are allowed.", code="input_too_long")


def input_chars(request: wire.ResponseRequest) -> int:
    """Characters of text in the input: message parts, function calls and outputs, reasoning summaries."""
    total = 0
    for item in request.input:
        if isinstance(item, wire.Message):
            total += sum(len(part.text) for part in item.content if isinstance(part, wire.TEXT_PARTS))
        elif isinstance(item, wire.FunctionCall):
            total += len(item.arguments)
        elif isinstance(item, wire.FunctionCallOutput):
            total += len(item.output)
        else:
            total += sum(len(part.text) for part in item.summary)
    return total


def _check_content(request: wire.ResponseRequest) -> None:
    for index, item in enumerate(request.input):
        if not isinstance(item, wire.Message):
            continue
        for part in item.content:
            if isinstance(part, _RESERVED_CONTENT):
                raise InvalidRequest(
                    f"input[{index}] has content of type {type(part).__struct_config__.tag!r}; "
                    "LMSP 1.0 defines text content only (input_text, output_text).",
                    code="unsupported_content_type",
                )


def _check_capabilities(request: wire.ResponseRequest, spec: ModelSpec) -> None:
    needs: list[tuple[bool, str, str]] = [
        (request.stream, "streaming", "stream: true"),
        (bool(request.tools) or request.tool_choice is not None, "tools", "tools"),
        (any(isinstance(i, wire.FunctionCall | wire.FunctionCallOutput) for i in request.input), "tools",
         "function_call input items"),
        (isinstance(request.response_format, wire.JsonSchemaFormat), "structured_output",
         "response_format json_schema"),
        (request.previous_response_id is not None, "conversations", "previous_response_id"),
    ]
    for needed, capability, what in needs:
        if needed and not spec.has(capability):  # type: ignore[arg-type]
            raise UnsupportedCapability(f"{what} needs the {capability!r} capability, which model "
                                        f"{spec.id!r} does not have.")


def _check_tools(request: wire.ResponseRequest) -> None:
    tools = request.tools or []
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise InvalidRequest(f"Two tools are named {duplicate!r}; tool names must be unique.",
                             code="duplicate_tool_name")
    for tool in tools:
        if tool.parameters.get("type", "object") != "object":
            raise InvalidRequest(f"The parameters of tool {tool.name!r} must be a JSON schema of type object.",
                                 code="invalid_tool_schema")
        if error := grammars.schema_grammar_error(tool.parameters):
            raise InvalidRequest(f"The parameters of tool {tool.name!r} are not a usable JSON schema: "
                                 f"{_first_line(error)}", code="invalid_tool_schema")
    choice = request.tool_choice
    if isinstance(choice, wire.NamedToolChoice) and choice.name not in names:
        raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools.", code="unknown_tool")
    if (choice == "required" or isinstance(choice, wire.NamedToolChoice)) and not tools:
        raise InvalidRequest("tool_choice requires a call but the request has no tools.", code="invalid_tool_choice")


def _check_calls(items: Sequence[wire.InputItem]) -> None:
    """Every function_call_output answers a function_call that comes before it in the input."""
    calls: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, wire.FunctionCall):
            calls.add(item.call_id)
        elif isinstance(item, wire.FunctionCallOutput) and item.call_id not in calls:
            raise InvalidRequest(f"input[{index}] is the output of call {item.call_id!r}, but no function_call "
                                 "with that call_id comes before it.", code="unmatched_call_id")


def _check_response_format(request: wire.ResponseRequest) -> None:
    if isinstance(request.response_format, wire.JsonSchemaFormat):
        spec = request.response_format.json_schema
        if error := grammars.schema_grammar_error(spec.schema):
            raise InvalidRequest(f"json_schema {spec.name!r} is not a usable JSON schema: {_first_line(error)}",
                                 code="invalid_json_schema")


def _first_line(message: str) -> str:
    """llguidance's message without its position prefix and its excerpt of the generated grammar."""
    lines = []
    for line in message.strip().splitlines():
        if re.match(r"\s+\d+ \|", line):
            break
        lines.append(line.strip())
    return " ".join(line for line in lines if line).split("failed to compile JSON schema: ", 1)[-1]


def output_budget(request: wire.ResponseRequest, spec: ModelSpec, prompt_tokens: int) -> int:
    """How many tokens the response may generate; raises if the prompt does not fit (6.1)."""
    room = spec.context_window - prompt_tokens
    wanted = request.max_output_tokens
    if wanted is not None and wanted > room:
        raise ContextLengthExceeded(
            f"The prompt has {prompt_tokens} tokens and max_output_tokens is {wanted}: together they "
            f"exceed the context window of {spec.context_window} tokens of model {spec.id!r}.")
    if room < 1:
        raise ContextLengthExceeded(
            f"The prompt has {prompt_tokens} tokens; the context window of model {spec.id!r} is "
            f"{spec.context_window} tokens, which leaves no room for output.")
    return wanted if wanted is not None else min(spec.max_output_tokens, room)


def check_output_room(request: wire.ResponseRequest, spec: ModelSpec, budget: int, needed: int | None) -> None:
    """Raise if the request's grammar (a forced tool call, json_schema output) cannot be completed in
    ``budget`` tokens: ``needed`` is its shortest output (``lmsp_core.requests.closing``; None: no minimum)."""
    if needed is None or needed <= budget:
        return
    calls = request.tool_choice == "required" or isinstance(request.tool_choice, wire.NamedToolChoice)
    what = "its tool call" if calls else "its json_schema object"
    if request.max_output_tokens is None and budget < spec.max_output_tokens:
        raise ContextLengthExceeded(
            f"The prompt leaves room for {budget} output tokens in the context window of model {spec.id!r}; "
            f"the shortest complete output ({what}) takes {needed}.")
    raise InvalidRequest(
        f"max_output_tokens is {budget}; the shortest complete output of this request ({what}) takes "
        f"{needed} tokens with model {spec.id!r}.", code="max_output_tokens_too_small")
