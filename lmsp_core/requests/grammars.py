"""Grammars for constrained decoding (llguidance), built from a request's tools and response format.

The API builds them to reject invalid schemas with a 400 before queueing; workers build the same
grammars and enforce them token by token, so tool-call arguments and json_schema output always
parse and validate.

Tool calls use one text format, whatever the model (see docs/protocol.md):
``<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>`` (one call per response unless the
request sets ``x-parallel_tool_calls``; several are separated by a newline). It is the format of
Hermes-style chat templates (Qwen, Hermes and others), so models whose template knows tools see
their native format, and others are told about it in the system prompt.
"""

import json
from collections.abc import Sequence
from typing import Any

import llguidance

from lmsp_core import wire
from lmsp_core.requests.catalog import ReasoningFormat

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_ONES = ("items", "not", "if", "then", "else", "additionalItems", "contains", "propertyNames")


def closed(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object schema that does not say.

    Any output of the closed schema validates against the original: the model may only write the
    properties the schema declares, rather than invent keys (which a grammar cannot bound)."""
    if not isinstance(schema, dict):
        return schema
    result = {key: value for key, value in schema.items()}
    for key in _SCHEMA_LISTS:
        if isinstance(result.get(key), list):
            result[key] = [closed(item) for item in result[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: closed(item) for name, item in result[key].items()}
    for key in _SCHEMA_ONES:
        if key in result:
            result[key] = closed(result[key])
    if isinstance(result.get("additionalProperties"), dict):
        result["additionalProperties"] = closed(result["additionalProperties"])
    is_object = result.get("type") == "object" or "properties" in result
    if is_object and "additionalProperties" not in result and "patternProperties" not in result:
        result["additionalProperties"] = False
    return result


def call_schema(tools: Sequence[wire.FunctionTool]) -> dict[str, Any]:
    """JSON schema of one call's body: the name of one of ``tools`` and its arguments."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": closed(tool.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json_lark(schema: dict[str, Any]) -> str:
    # compact JSON: with free whitespace a model can pad forever between tokens
    options = {"whitespace_flexible": False}
    return f"%json {json.dumps({**schema, 'x-guidance': options})}"


def generation_grammar(request: wire.ResponseRequest, reasoning: ReasoningFormat | None = None) -> str | None:
    """The llguidance grammar the output must follow, or None when it is free text.

    A response makes one call unless it asks for several (``x-parallel_tool_calls``): small models
    that were not trained for tools otherwise repeat the same call until the token budget runs out.
    For a reasoning model the grammar starts with the reasoning section (free text up to the first
    end marker, then optional whitespace), so the answer's grammar applies after it only."""
    parallel_calls = request.known_extensions.parallel_tool_calls
    if reasoning is None:
        answer = _answer_lark(request, parallel_calls, "start", after_reasoning=False)
        return None if answer is None else llguidance.LLMatcher.grammar_from_lark(answer)
    answer = _answer_lark(request, parallel_calls, "reply", after_reasoning=True)
    return None if answer is None else llguidance.LLMatcher.grammar_from_lark(answer + _reasoning_lark(reasoning))


def _reasoning_lark(reasoning: ReasoningFormat) -> str:
    section = f"think[suffix={json.dumps(reasoning.end)}]: /(?s:.*)/\nAFTER_THINK: /[ \\t\\r\\n]*/\n"
    if reasoning.opened_by == "model":  # the model may open a section first (after whitespace), or not
        return f"start: (/[ \\t\\r\\n]*/ {json.dumps(reasoning.start)} think AFTER_THINK)? reply\n" + section
    return "start: think AFTER_THINK reply\n" + section


def _answer_lark(request: wire.ResponseRequest, parallel_calls: bool, rule: str, after_reasoning: bool) -> str | None:
    """The answer's grammar in lark (its top rule named ``rule``), or None for free text. After a
    reasoning section, whitespace before the answer belongs to the section, so free text must not
    start like a call even after whitespace (the output assembler sees the answer without it)."""
    choice = request.tool_choice or "auto"
    schema = request.response_format.json_schema.schema if isinstance(
        request.response_format, wire.JsonSchemaFormat) else None
    lead = "[ \\t\\r\\n]*" if after_reasoning else ""
    text = f"TEXT: /(.|\\n)*/ & ~/{lead}{CALL_OPEN}(.|\\n)*/\n"  # any text that does not start like a call
    if schema is not None and (not request.tools or choice == "none"):
        return f"{rule}: body\nbody: {_json_lark(closed(schema))}\n"
    if not request.tools:
        return None
    if choice == "none":  # the tools are in the prompt, but the output must not be a call
        return f"{rule}: TEXT\n" + text
    tools = request.tools
    if isinstance(choice, wire.NamedToolChoice):
        tools = [tool for tool in tools if tool.name == choice.name]
    repeat = ' ("\\n" call)*' if parallel_calls else ""
    calls = (f'calls: call{repeat}\ncall: "{CALL_OPEN}" body "{CALL_CLOSE}"\n'
             f"body: {_json_lark(call_schema(tools))}\n")
    if choice != "auto":  # "required" or a named function: the output is calls only
        return f"{rule}: calls\n" + calls
    if schema is not None:  # a call, or the structured answer
        return f"{rule}: calls | answer\nanswer: {_json_lark(closed(schema))}\n" + calls
    return f"{rule}: calls | TEXT\n" + text + calls


def grammar_error(grammar: str) -> str | None:
    """Why llguidance refuses the grammar (an invalid or unsupported schema), or None."""
    message = llguidance.LLMatcher.validate_grammar(grammar)
    return message or None


def schema_grammar_error(schema: dict[str, Any]) -> str | None:
    """Why a JSON schema cannot be enforced, or None."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(f"start: body\nbody: {_json_lark(closed(schema))}\n")
    except (ValueError, TypeError) as exc:
        return str(exc)
    return grammar_error(grammar)
