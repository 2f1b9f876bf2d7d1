"""OpenAI's chat completion bodies -> LMSP requests (``wire.ResponseRequest``): the chat messages as input
items, chat's parameters as the Responses translation (``api.openai.translation``) takes them, whose
checks both share. Everything a body asks for is translated or refused with a 400 naming the parameter.
"""

from typing import Any, Literal

from api.openai import requests as oa
from api.openai.errors import unsupported
from api.openai.translation import (
    JSON_OBJECT,
    PENALTIES,
    SHARED_PARAMS,
    check_capabilities,
    common_options,
    converted,
    extensions_of,
    text_of,
    tool_choice_of,
    tools_of,
    with_client_options,
)
from lmsp_core import wire
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.wire.errors import InvalidRequest

# the parameter behind each code of the shared checks (errors.with_param)
CHAT_PARAMS = {**SHARED_PARAMS, "context_length_exceeded": "messages", "too_many_input_items": "messages",
               "input_too_long": "messages", "unmatched_call_id": "messages",
               "invalid_json_schema": "response_format", "max_output_tokens_too_large": "max_completion_tokens",
               "max_output_tokens_too_small": "max_completion_tokens"}


def chat_request(body: oa.ChatRequest, spec: ModelSpec) -> wire.ResponseRequest:
    _check_chat_options(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequest("Set max_completion_tokens or max_tokens, not both.", extra={"param": "max_tokens"})
    request = wire.ResponseRequest(
        model=body.model, input=chat_items(body.messages), stream=bool(body.stream),
        max_output_tokens=body.max_completion_tokens or body.max_tokens, temperature=body.temperature,
        response_format=_chat_format(body.response_format), tools=tools_of(
            [tool.function for tool in body.tools] if body.tools is not None else None, "tools"),
        tool_choice=tool_choice_of(body.tool_choice), extensions=with_client_options(extensions_of(
            top_p=body.top_p, seed=body.seed, stop=body.stop, logprobs=chat_logprobs(body)), body),
    )
    check_capabilities(request, spec, input_param="messages", format_param="response_format")
    return request


_NO_EFFECT: list[tuple[str, Any, str]] = [
    ("n", (None, 1), "One choice is returned (n: 1)."),
    *PENALTIES,
    ("store", (None, False), "Chat completions are not stored (store: false); use /v1/responses to store."),
    ("modalities", (None, ["text"]), "Only the text modality is supported."),
]


def _check_chat_options(body: oa.ChatRequest) -> None:
    for name, allowed, message in _NO_EFFECT:
        if getattr(body, name) not in allowed:
            raise unsupported(name, message)
    common_options(body.service_tier, body.top_logprobs)
    if body.stream_options is not None:
        if not body.stream:
            raise InvalidRequest("stream_options is only allowed with stream: true.",
                                 extra={"param": "stream_options"})
        if body.stream_options.include_obfuscation:
            raise unsupported("stream_options.include_obfuscation", "Stream obfuscation is not supported.")


def _chat_format(chosen: oa.TextFormat | oa.JsonObjectFormat | oa.ChatJsonSchemaFormat | None
                 ) -> wire.ResponseFormat | None:
    if isinstance(chosen, oa.JsonObjectFormat):
        return wire.JsonSchemaFormat(json_schema=JSON_OBJECT)
    if isinstance(chosen, oa.ChatJsonSchemaFormat):
        schema = chosen.json_schema
        spec = converted({"name": schema.name, "description": schema.description, "strict": schema.strict,
                          "schema": schema.schema if schema.schema is not None else {"type": "object"}},
                         wire.JsonSchemaSpec, "response_format.json_schema")
        return wire.JsonSchemaFormat(json_schema=spec)
    return wire.TextFormat() if chosen is not None else None


def chat_items(messages: list[dict[str, Any]]) -> list[wire.InputItem]:
    items: list[wire.InputItem] = []
    for index, raw in enumerate(messages):
        param = f"messages[{index}]"
        message: oa.ChatMessage = converted(raw, oa.ChatMessage, param)
        _check_fields(message, param)
        items += _chat_message(message, param)
    return items


_ROLE_FIELDS = {"tool_calls": "assistant", "reasoning_content": "assistant", "tool_call_id": "tool"}


def _check_fields(message: oa.ChatMessage, param: str) -> None:
    for field, role in _ROLE_FIELDS.items():
        if getattr(message, field) is not None and message.role != role:
            raise InvalidRequest(f"{field} is only allowed in {role} messages.", extra={"param": f"{param}.{field}"})
    if message.annotations:
        raise unsupported(f"{param}.annotations", "Annotations are not supported in input.")
    if message.role == "tool" and message.tool_call_id is None:
        raise InvalidRequest("A tool message needs tool_call_id.", extra={"param": f"{param}.tool_call_id"})
    if message.role not in ("assistant",) and message.content is None:
        raise InvalidRequest(f"A {message.role} message needs content.", extra={"param": f"{param}.content"})


def _chat_message(message: oa.ChatMessage, param: str) -> list[wire.InputItem]:
    content = message.content
    text = content if isinstance(content, str) or content is None else text_of(content, param)
    if message.role == "tool":
        assert message.tool_call_id is not None
        return [wire.FunctionCallOutput(call_id=message.tool_call_id, output=text or "")]
    if message.role != "assistant":
        role: Literal["system", "user"] = "user" if message.role == "user" else "system"
        return [wire.Message(role=role, content=[wire.InputText(text=text or "")])]
    items: list[wire.InputItem] = []
    if message.reasoning_content:
        items.append(wire.Reasoning(summary=[wire.SummaryText(text=message.reasoning_content)]))
    if text or not message.tool_calls:
        items.append(wire.Message(role="assistant", content=[wire.OutputText(text=text or "")]))
    for index, call in enumerate(message.tool_calls or ()):
        items.append(converted({"type": "function_call", "call_id": call.id, "name": call.function.name,
                                "arguments": call.function.arguments}, wire.FunctionCall,
                               f"{param}.tool_calls[{index}].function"))
    return items


def chat_logprobs(body: oa.ChatRequest) -> int | None:
    """The same for chat: ``logprobs: true``, with ``top_logprobs`` alternatives (which need it)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true.", code="invalid_value",
                             extra={"param": "top_logprobs"})
    return (body.top_logprobs or 0) if body.logprobs else None
