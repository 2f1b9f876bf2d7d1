"""OpenAI's Responses bodies -> LMSP requests (``wire.ResponseRequest``), which then take the ordinary
submit path, and the checks chat's translation (``api.openai.chattranslation``) shares. Everything a
body asks for is either translated or refused with a 400 that names the parameter; nothing is dropped
silently.

How the response object echoes a request (``instructions``, a ``json_object`` format) is kept in
the request itself, in the private extension ``x-openai``, which workers ignore: the task stays the
only record of what was asked.
"""

import re
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import msgspec

from api.openai import compactionitem
from api.openai import requests as oa
from api.openai.errors import join, unsupported, validation_param
from lmsp_core import wire
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.wire import Capability
from lmsp_core.wire import extensions as ext
from lmsp_core.wire.errors import InvalidRequest, UnsupportedCapability
from lmsp_core.wire.extensions import SEED, STOP, TOP_P

EXTENSION = "x-openai"
JSON_OBJECT = wire.JsonSchemaSpec(name="json_object", schema={"type": "object"})
DEFAULT_TIERS = (None, "auto", "default")
_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")  # where in a converted value msgspec found a fault

INCLUDE_LOGPROBS = "message.output_text.logprobs"
# the queue priority of a service tier (docs/protocol.md, "Priorities"); OpenAI answers fast as priority
TIER_PRIORITIES: dict[str, ext.Priority] = {"flex": "low", "priority": "high", "fast": "high"}
MAX_USER = 256  # this service's bound: OpenAI documents none
MAX_SAFETY_IDENTIFIER = 128  # OpenAI's

# the parameter behind each code of the shared checks, per endpoint (errors.with_param)
SHARED_PARAMS = {"model_not_found": "model", "max_output_tokens_too_large": "max_output_tokens",
                  "max_output_tokens_too_small": "max_output_tokens",
                  "too_many_tools": "tools", "duplicate_tool_name": "tools", "invalid_tool_schema": "tools",
                  "unknown_tool": "tool_choice", "invalid_tool_choice": "tool_choice"}
RESPONSES_PARAMS = {**SHARED_PARAMS, "context_length_exceeded": "input", "too_many_input_items": "input",
                    "input_too_long": "input", "unmatched_call_id": "input", "invalid_json_schema": "text.format",
                    "response_not_found": "previous_response_id", "previous_response_in_progress":
                    "previous_response_id", "conversation_too_long": "previous_response_id",
                    "conversation_not_found": "conversation", "conversation_locked": "conversation"}

# --- POST /v1/responses ------------------------------------------------------------------------------


def responses_request(body: oa.ResponsesRequest, spec: ModelSpec) -> wire.ResponseRequest:
    _check_response_options(body)
    store = stored(body, spec)
    if body.background and not store:
        raise unsupported("background", "A background response must be stored (store: true) so that it can be "
                                        "retrieved, resumed and cancelled.")
    items = input_items(body.input)
    if body.instructions is not None:
        items = [wire.Message(role="system", content=[wire.InputText(text=body.instructions)]), *items]
    response_format, echo = _text_format(body.text)
    if body.instructions is not None:
        echo["instructions"] = True
    if body.conversation is not None:
        echo["conversation"] = conversation_id(body)
    request = wire.ResponseRequest(
        model=body.model, input=items, stream=bool(body.stream), max_output_tokens=body.max_output_tokens,
        temperature=body.temperature, response_format=response_format, tools=tools_of(body.tools, "tools"),
        tool_choice=tool_choice_of(body.tool_choice), store=store, previous_response_id=body.previous_response_id,
        extensions=with_client_options(extensions_of(top_p=body.top_p, echo=echo,
                                                   logprobs=responses_logprobs(body)), body),
    )
    check_capabilities(request, spec, input_param="input", format_param="text.format")
    return request


def conversation_id(body: oa.ResponsesRequest) -> str | None:
    """The conversation a response continues (``api.openai.conversations``); not with
    ``previous_response_id``, as on OpenAI."""
    chosen = body.conversation
    if chosen is not None and body.previous_response_id is not None:
        raise InvalidRequest("Mutually exclusive parameters: provide either 'previous_response_id' or "
                             "'conversation', not both.", code="mutually_exclusive_parameters",
                             extra={"param": "conversation"})
    return chosen.id if isinstance(chosen, oa.ConversationParam) else chosen


def counted_request(body: oa.InputTokensRequest, spec: ModelSpec) -> wire.ResponseRequest:
    """The request whose prompt ``POST /v1/responses/input_tokens`` counts: what ``POST /v1/responses``
    makes of the same input, instructions, tools and conversation, checked alike. Without ``input``,
    the instructions alone (the system message they become)."""
    given, instructions = body.input, body.instructions
    if given is None:
        if instructions is None:
            raise InvalidRequest("Missing required parameter: 'input' (or 'instructions').",
                                 extra={"param": "input"})
        given, instructions = [{"role": "system", "content": instructions}], None
    return responses_request(oa.ResponsesRequest(
        model=body.model, input=given, instructions=instructions, tools=body.tools, tool_choice=body.tool_choice,
        text=body.text, previous_response_id=body.previous_response_id,
        parallel_tool_calls=body.parallel_tool_calls, truncation=body.truncation), spec)


def stored(body: oa.ResponsesRequest, spec: ModelSpec) -> bool:
    """``store`` defaults to true, as on OpenAI, where the model can store responses."""
    if body.store is None:
        return spec.has("conversations")
    if body.store:
        _require(spec, "conversations", "store", "store: true")
    return body.store


# parameters both routes accept only with the value that asks for what the service does: (name, allowed, message)
PENALTIES: list[tuple[str, Any, str]] = [
    ("frequency_penalty", (None, 0), "frequency_penalty is not supported (only 0)."),
    ("presence_penalty", (None, 0), "presence_penalty is not supported (only 0)."),
]


def _check_response_options(body: oa.ResponsesRequest) -> None:
    for name, allowed, message in PENALTIES:
        if getattr(body, name) not in allowed:
            raise unsupported(name, message)
    if body.truncation == "auto":
        raise unsupported("truncation", "truncation: auto is not supported: input that does not fit the context "
                                        "window is refused (context_length_exceeded).")
    other = [name for name in body.include or () if name != INCLUDE_LOGPROBS]
    if other:
        raise unsupported("include", f"include {other!r} is not supported: only {INCLUDE_LOGPROBS!r} can be "
                                     "included.")
    common_options(body.service_tier, body.top_logprobs)
    if body.max_tool_calls is not None:
        raise unsupported("max_tool_calls", "max_tool_calls is not supported.", value=False)
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise unsupported("stream_options.include_obfuscation", "Stream obfuscation is not supported.")


def common_options(service_tier: str | None, top_logprobs: int | None) -> None:
    if service_tier not in DEFAULT_TIERS and service_tier not in TIER_PRIORITIES:
        raise unsupported("service_tier", f"service_tier {service_tier!r} is not supported; use 'auto', 'default', "
                                          "'flex' or 'priority'.")
    if top_logprobs is not None and not 0 <= top_logprobs <= ext.MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be from 0 to {ext.MAX_TOP_LOGPROBS}.", code="invalid_value",
                             extra={"param": "top_logprobs"})


def responses_logprobs(body: oa.ResponsesRequest) -> int | None:
    """How many alternatives each output token reports (None: no log-probabilities): asked for by
    ``include``, or by ``top_logprobs`` above 0."""
    if INCLUDE_LOGPROBS in (body.include or ()) or body.top_logprobs:
        return body.top_logprobs or 0
    return None


def _text_format(text: oa.TextConfig | None) -> tuple[wire.ResponseFormat | None, dict[str, Any]]:
    chosen = text.format if text is not None else None
    if isinstance(chosen, oa.JsonObjectFormat):
        return wire.JsonSchemaFormat(json_schema=JSON_OBJECT), {"format": "json_object"}
    if isinstance(chosen, oa.JsonSchemaFormat):
        spec = converted({"name": chosen.name, "schema": chosen.schema, "description": chosen.description,
                          "strict": chosen.strict}, wire.JsonSchemaSpec, "text.format")
        return wire.JsonSchemaFormat(json_schema=spec), {}
    return (wire.TextFormat() if chosen is not None else None), {}


def tools_of(tools: Sequence[oa.FunctionTool | oa.FunctionDefinition] | None,
           param: str) -> list[wire.FunctionTool] | None:
    if tools is None:
        return None
    return [converted({"type": "function", "name": tool.name, "description": tool.description or "",
                       "parameters": tool.parameters if tool.parameters is not None else {"type": "object"},
                       "strict": tool.strict}, wire.FunctionTool, f"{param}[{index}]" + (
                           ".function" if isinstance(tool, oa.FunctionDefinition) else ""))
            for index, tool in enumerate(tools)]


def tool_choice_of(choice: str | oa.NamedFunction | oa.ChatNamedTool | None) -> wire.ToolChoice | None:
    if isinstance(choice, oa.NamedFunction):
        return converted({"type": "function", "name": choice.name}, wire.NamedToolChoice, "tool_choice")
    if isinstance(choice, oa.ChatNamedTool):
        return converted({"type": "function", "name": choice.function.name}, wire.NamedToolChoice,
                         "tool_choice.function")
    return choice  # type: ignore[return-value]  # the Literal of the request type


def extensions_of(*, top_p: float | None = None, seed: int | None = None, stop: str | list[str] | None = None,
                echo: dict[str, Any] | None = None, logprobs: int | None = None) -> dict[str, Any] | None:
    extensions: dict[str, Any] = {}
    if logprobs is not None:
        extensions[ext.LOGPROBS] = logprobs
    if top_p is not None:
        extensions[TOP_P] = top_p
    if seed is not None:
        extensions[SEED] = seed
    if stop:
        extensions[STOP] = stop
    if echo:
        extensions[EXTENSION] = echo
    return extensions or None


def echo_of(request: wire.ResponseRequest) -> dict[str, Any]:
    """What ``x-openai`` recorded about the translation of a request."""
    return echo_in(request.extensions)


def echo_in(extensions: dict[str, Any] | None) -> dict[str, Any]:
    echo = (extensions or {}).get(EXTENSION)
    return echo if isinstance(echo, dict) else {}


def tier_of(request: wire.ResponseRequest) -> Literal["default", "flex", "priority"]:
    """The service tier a request was served with: its queue priority, if it chose one."""
    chosen = ext.parse(request.extensions).priority
    return "priority" if chosen == "high" else "flex" if chosen == "low" else "default"


# --- what both routes take: parameters kept with the task, and their limits ------------------------------


def with_client_options(extensions: dict[str, Any] | None, body: oa.ClientOptions) -> dict[str, Any] | None:
    """``extensions`` with what the body's shared parameters ask for: the function calls in one answer,
    metadata, prompt_cache_key and service_tier as extensions (the worker and the LMSP routes see them),
    ``user`` and ``safety_identifier`` in ``x-openai`` (only echoed: nothing else reads them)."""
    _check_limits(body)
    added: dict[str, Any] = {ext.PARALLEL_TOOL_CALLS: body.parallel_tool_calls, ext.METADATA: body.metadata,
                             ext.PROMPT_CACHE_KEY: body.prompt_cache_key,
                             ext.PRIORITY: TIER_PRIORITIES.get(body.service_tier or "")}
    result = {**(extensions or {}), **{name: value for name, value in added.items() if value is not None}}
    who = {name: value for name, value in (("user", body.user), ("safety_identifier", body.safety_identifier))
           if value is not None}
    if who:
        result[EXTENSION] = {**echo_in(result), **who}
    return result or None


def _check_limits(body: oa.ClientOptions) -> None:
    """OpenAI's limits, with OpenAI's codes (``object_above_max_properties``, ``string_above_max_length``)."""
    metadata = body.metadata or {}
    if len(metadata) > ext.MAX_METADATA_PAIRS:
        raise InvalidRequest(f"Invalid 'metadata': too many properties. Expected an object with at most "
                             f"{ext.MAX_METADATA_PAIRS} properties, but got an object with {len(metadata)} "
                             "properties instead.", code="object_above_max_properties", extra={"param": "metadata"})
    for key, value in metadata.items():
        _check_length("metadata", key, ext.MAX_METADATA_KEY, what="key")
        if not isinstance(value, str):
            raise InvalidRequest(f"Invalid type for 'metadata.{key}': expected a string.",
                                 extra={"param": f"metadata.{key}"})
        _check_length(f"metadata.{key}", value, ext.MAX_METADATA_VALUE)
    _check_length("prompt_cache_key", body.prompt_cache_key, ext.MAX_PROMPT_CACHE_KEY)
    _check_length("safety_identifier", body.safety_identifier, MAX_SAFETY_IDENTIFIER)
    _check_length("user", body.user, MAX_USER)


def _check_length(param: str, value: str | None, limit: int, what: str = "string") -> None:
    if value is not None and len(value) > limit:
        raise InvalidRequest(f"Invalid {param!r}: {what} too long. Expected a {what} with maximum length {limit}, "
                             f"but got a {what} with length {len(value)} instead.", code="string_above_max_length",
                             extra={"param": param})


# --- input items -------------------------------------------------------------------------------------


def input_items(raw: str | list[dict[str, Any]], param: str = "input") -> list[wire.InputItem]:
    if isinstance(raw, str):
        return [wire.Message(role="user", content=[wire.InputText(text=raw)])]
    if not raw:
        raise InvalidRequest(f"{param} must not be empty.", extra={"param": param})
    return [_input_item(item, f"{param}[{index}]") for index, item in enumerate(raw)]


def _input_item(item: dict[str, Any], param: str) -> wire.InputItem:
    kind = item.get("type", "message")
    if kind == "message":
        message: oa.MessageItem = converted(item, oa.MessageItem, param)
        role = "system" if message.role == "developer" else message.role
        return wire.Message(role=role, content=_parts(message.content, param, role), id=message.id)
    if kind == "function_call":
        call: oa.FunctionCallItem = converted(item, oa.FunctionCallItem, param)
        return converted({"type": "function_call", "call_id": call.call_id, "name": call.name,
                          "arguments": call.arguments, "id": call.id}, wire.FunctionCall, param)
    if kind == "function_call_output":
        output: oa.FunctionCallOutputItem = converted(item, oa.FunctionCallOutputItem, param)
        text = output.output if isinstance(output.output, str) else text_of(output.output, f"{param}.output")
        return wire.FunctionCallOutput(call_id=output.call_id, output=text, id=output.id)
    if kind == "reasoning":
        reasoning: oa.ReasoningItem = converted(item, oa.ReasoningItem, param)
        if reasoning.content:
            raise unsupported(f"{param}.content", "Reasoning content (reasoning_text) is not supported as input; "
                                                  "send the summary.")
        return wire.Reasoning(summary=[wire.SummaryText(text=part.text) for part in reasoning.summary],
                              id=reasoning.id)
    if kind == compactionitem.TYPE:
        return compactionitem.as_input(converted(item, compactionitem.CompactionItem, param))
    raise unsupported(f"{param}.type", f"Input items of type {kind!r} are not supported; use message, "
                                       "function_call, function_call_output, reasoning or compaction.")


TEXT_TYPES = ("input_text", "output_text", "text")


def _parts(content: str | list[dict[str, Any]], param: str, role: str) -> list[wire.ContentPart]:
    if isinstance(content, str):
        return [wire.OutputText(text=content) if role == "assistant" else wire.InputText(text=content)]
    parts: list[wire.ContentPart] = []
    for index, raw in enumerate(content):
        where = f"{param}.content[{index}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in TEXT_TYPES:  # before decoding: an image part's fields are not a text part's
            raise InvalidRequest(f"Content of type {kind!r} is not supported: this service takes text only.",
                                 code="unsupported_content_type", extra={"param": f"{where}.type"})
        part: oa.ContentPart = converted(raw, oa.ContentPart, where)
        if part.text is None:
            raise InvalidRequest("A text part needs text.", extra={"param": f"{where}.text"})
        if part.annotations:
            raise unsupported(f"{where}.annotations", "Annotations are not supported in input.")
        parts.append(wire.OutputText(text=part.text) if part.type == "output_text" else wire.InputText(text=part.text))
    return parts


def text_of(content: list[dict[str, Any]], param: str) -> str:
    """The text of a list of text parts (a tool's output, or a chat message's content)."""
    return "".join(part.text for part in _parts(content, param, "user") if isinstance(part, wire.TEXT_PARTS))


# --- capabilities, with the parameter that needs them ----------------------------------------------------


def _require(spec: ModelSpec, capability: Capability, param: str, what: str) -> None:
    if not spec.has(capability):
        raise UnsupportedCapability(f"{what} needs the {capability!r} capability, which model {spec.id!r} does "
                                    "not have.", extra={"param": param})


def check_capabilities(request: wire.ResponseRequest, spec: ModelSpec, *, input_param: str,
                        format_param: str) -> None:
    if request.stream:
        _require(spec, "streaming", "stream", "stream: true")
    if request.tools or request.tool_choice is not None:
        _require(spec, "tools", "tools", "tools")
    if any(isinstance(item, wire.FunctionCall | wire.FunctionCallOutput) for item in request.input):
        _require(spec, "tools", input_param, "Function calls and their outputs")
    if isinstance(request.response_format, wire.JsonSchemaFormat):
        _require(spec, "structured_output", format_param, "A JSON output format")
    if request.previous_response_id is not None:
        _require(spec, "conversations", "previous_response_id", "previous_response_id")
    if echo_of(request).get("conversation") is not None:
        _require(spec, "conversations", "conversation", "conversation")


T = TypeVar("T")


def converted(value: Any, type_: type[T], param: str) -> T:
    """``msgspec.convert`` with its errors as 400s naming the parameter (``param`` is where ``value``
    sits in the request)."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        message = str(exc)
        at = _AT.search(message)
        path = join(param, at["path"]) if at else param
        bare = message[: at.start()] if at else message
        where, code, text = validation_param(bare, path)
        raise InvalidRequest(text, code=code, extra={"param": where}) from None
