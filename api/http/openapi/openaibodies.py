"""What the ``/v1`` request bodies accept, for the OpenAPI document, where their types alone say
less: input items and chat messages are decoded item by item (``api.openai.translation``), so
their fields are ``dict``s to msgspec and their schemas are written here from the item types and
the rules the translation checks."""

from typing import Any

from api.http.openapi.eventstreams import JsonSchema, json_schema
from api.http.strictbodies import StructDoc
from api.openai import batches as ob
from api.openai import compaction
from api.openai import conversations as oc
from api.openai import requests as rq
from api.openai.compactionitem import CompactionItem
from api.openai.translation import (
    DEFAULT_TIERS,
    INCLUDE_LOGPROBS,
    MAX_SAFETY_IDENTIFIER,
    MAX_USER,
    TEXT_TYPES,
    TIER_PRIORITIES,
)
from lmsp_core import wire
from lmsp_core.wire import extensions as ext

NULL: JsonSchema = {"type": "null"}
EMPTY: JsonSchema = {"anyOf": [{"type": "array", "maxItems": 0}, NULL]}  # echoed back, must be empty
TOOL_NAME: JsonSchema = json_schema(wire.ToolName)
FORMAT_NAME: JsonSchema = json_schema(wire.JsonSchemaSpec)["properties"]["name"]
DESCRIPTION: JsonSchema = {"anyOf": [json_schema(wire.FunctionTool)["properties"]["description"], NULL]}


def _with(kind: Any, **properties: JsonSchema) -> JsonSchema:
    """The JSON Schema of ``kind`` with some of its properties' schemas replaced."""
    schema = json_schema(kind)
    schema["properties"] = {**schema["properties"], **properties}
    return schema


TEXT_PART = _with(rq.ContentPart, type={"enum": list(TEXT_TYPES)}, text={"type": "string"}, annotations=EMPTY)
TEXT_PART["required"] = ["type", "text"]
TEXT: JsonSchema = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}

INPUT_ITEMS: list[JsonSchema] = [
    _with(rq.MessageItem, content=TEXT),
    _with(rq.FunctionCallItem, name=TOOL_NAME),
    _with(rq.FunctionCallOutputItem, output=TEXT),
    _with(rq.ReasoningItem, content=EMPTY),
    json_schema(CompactionItem),
]

_CALL = _with(rq.ToolCall, function=_with(rq.ToolCallFunction, name=TOOL_NAME))
CHAT_MESSAGE = _with(rq.ChatMessage, content={"anyOf": [*TEXT["anyOf"], NULL]}, annotations=EMPTY,
                     tool_calls={"anyOf": [{"type": "array", "items": _CALL}, NULL]})
CHAT_MESSAGE["allOf"] = [
    # tool_calls and reasoning_content only in an assistant message, which alone may lack content
    {"if": {"properties": {"role": {"const": "assistant"}}},
     "else": {"required": ["content"], "properties": {"content": {"not": NULL}, "tool_calls": NULL,
                                                      "reasoning_content": NULL}}},
    # tool_call_id in a tool message, and only there
    {"if": {"properties": {"role": {"const": "tool"}}},
     "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
     "else": {"properties": {"tool_call_id": NULL}}},
]


def _bounded(limit: int) -> JsonSchema:
    return {"anyOf": [{"type": "string", "maxLength": limit}, NULL]}


# the limits the translation checks itself, to answer with OpenAI's codes (string_above_max_length, ...)
CLIENT_OPTIONS: dict[str, JsonSchema] = {
    "metadata": {"anyOf": [{"type": "object", "maxProperties": ext.MAX_METADATA_PAIRS,
                            "propertyNames": {"maxLength": ext.MAX_METADATA_KEY},
                            "additionalProperties": {"type": "string", "maxLength": ext.MAX_METADATA_VALUE}}, NULL]},
    "prompt_cache_key": _bounded(ext.MAX_PROMPT_CACHE_KEY),
    "safety_identifier": _bounded(MAX_SAFETY_IDENTIFIER),
    "user": _bounded(MAX_USER),
}

def _nullable(schema: JsonSchema) -> JsonSchema:
    return {"anyOf": [schema, NULL]}


# accepted only with the values that ask for what the service does, the translation's checks
# (400 unsupported_value otherwise): no penalty, the service tiers that are queue priorities, ...
PENALTIES: dict[str, JsonSchema] = {name: _nullable({"type": "number", "const": 0})
                                    for name in ("frequency_penalty", "presence_penalty")}
_OPTIONS: dict[str, JsonSchema] = {
    "service_tier": _nullable({"enum": [*(tier for tier in DEFAULT_TIERS if tier), *TIER_PRIORITIES]}),
    "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": ext.MAX_TOP_LOGPROBS}),
    **PENALTIES,
}
RESPONSES_OPTIONS: dict[str, JsonSchema] = {
    **_OPTIONS,
    "truncation": _nullable({"const": "disabled"}),
    "include": _nullable({"type": "array", "items": {"const": INCLUDE_LOGPROBS}}),
    "max_tool_calls": NULL,
}
CHAT_OPTIONS: dict[str, JsonSchema] = {
    **_OPTIONS,
    "n": _nullable({"type": "integer", "const": 1}),
    "store": _nullable({"type": "boolean", "const": False}),
    "modalities": _nullable({"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}),
}
NO_OBFUSCATION: JsonSchema = {"include_obfuscation": _nullable({"type": "boolean", "const": False})}
# a background response is stored, to be retrieved, resumed and cancelled
BACKGROUND_STORED: JsonSchema = {
    "if": {"required": ["background"], "properties": {"background": {"const": True}}},
    "then": {"properties": {"store": {"not": {"const": False}}}}}
INPUT: JsonSchema = {"anyOf": [{"type": "string"},
                               {"type": "array", "minItems": 1, "items": {"anyOf": INPUT_ITEMS}}]}

ITEMS: JsonSchema = {"type": "array", "maxItems": oc.MAX_ITEMS, "items": {"anyOf": INPUT_ITEMS}}

BODIES: dict[type, StructDoc] = {
    rq.ResponsesRequest: StructDoc(fields={"input": INPUT, **CLIENT_OPTIONS, **RESPONSES_OPTIONS}, rules=[
        # a conversation, or the previous response: not both (400 mutually_exclusive_parameters)
        {"not": {"required": ["previous_response_id", "conversation"],
                 "properties": {"previous_response_id": {"type": "string"}, "conversation": {"not": NULL}}}},
        BACKGROUND_STORED]),
    rq.ResponsesStreamOptions: StructDoc(fields=NO_OBFUSCATION),
    rq.ChatStreamOptions: StructDoc(fields=NO_OBFUSCATION),
    # input, or instructions alone
    rq.InputTokensRequest: StructDoc(fields={"input": {"anyOf": [*INPUT["anyOf"], NULL]},
                                             "truncation": RESPONSES_OPTIONS["truncation"]}, rules=[
        {"anyOf": [{"required": ["input"], "properties": {"input": {"not": NULL}}},
                   {"required": ["instructions"], "properties": {"instructions": {"type": "string"}}}]}]),
    # input, or the stored turns of previous_response_id, or both
    compaction.CompactRequest: StructDoc(fields={"input": {"anyOf": [*INPUT["anyOf"], NULL]}}, rules=[
        {"anyOf": [{"required": ["input"], "properties": {"input": {"not": NULL}}},
                   {"required": ["previous_response_id"],
                    "properties": {"previous_response_id": {"type": "string"}}}]}]),
    rq.ChatRequest: StructDoc(fields={
        "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
        **CLIENT_OPTIONS, **CHAT_OPTIONS,
    }, rules=[
        {"not": {"required": ["max_tokens", "max_completion_tokens"],
                 "properties": {"max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}}},
        {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
         "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}},
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
    ]),
    # items as a response's input items, at most 20 at once
    oc.ConversationCreate: StructDoc(fields={"items": {"anyOf": [ITEMS, NULL]},
                                             "metadata": CLIENT_OPTIONS["metadata"]}),
    oc.ConversationUpdate: StructDoc(fields={"metadata": CLIENT_OPTIONS["metadata"]}),
    oc.ItemsCreate: StructDoc(fields={"items": {**ITEMS, "minItems": 1}}),
    # names and descriptions become the service's own (wire) tools and formats, with their constraints
    rq.FunctionTool: StructDoc(fields={"name": TOOL_NAME, "description": DESCRIPTION}),
    rq.FunctionDefinition: StructDoc(fields={"name": TOOL_NAME, "description": DESCRIPTION}),
    rq.NamedFunction: StructDoc(fields={"name": TOOL_NAME}),
    rq.ChatNamedFunction: StructDoc(fields={"name": TOOL_NAME}),
    rq.JsonSchemaFormat: StructDoc(fields={"name": FORMAT_NAME}),
    rq.ChatJsonSchema: StructDoc(fields={"name": FORMAT_NAME}),
    ob.BatchCreate: StructDoc(fields={
        "endpoint": {"enum": list(ob.ENDPOINTS)},
        "completion_window": {"type": "string", "pattern": ob.WINDOW_PATTERN,
                              "description": "`24h` or shorter, in one unit: `1h`, `30m`, `90s`"},
        "metadata": CLIENT_OPTIONS["metadata"],
    }),
}
