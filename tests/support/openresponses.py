"""What Open Responses' schema requires of the ``/v1/responses`` objects and stream events: our own field
lists, read from its ``ResponseResource``, item, content and streaming-event schemas (the compliance
suite validates every body and SSE event against them; docs/protocol.md, "Open Responses")."""

from typing import Any

# the fields its ResponseResource requires (its schema's `required`, some nullable): every response
# object of /v1/responses has them, in bodies and in lifecycle events alike
RESPONSE_RESOURCE = frozenset({
    "background", "completed_at", "created_at", "error", "frequency_penalty", "id", "incomplete_details",
    "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "object", "output",
    "parallel_tool_calls", "presence_penalty", "previous_response_id", "prompt_cache_key", "reasoning",
    "safety_identifier", "service_tier", "status", "store", "temperature", "text", "tool_choice", "tools",
    "top_logprobs", "top_p", "truncation", "usage", "user"})

# a field's JSON type, as the schema names it: "int" is an integer that is not a boolean, "str?" nullable
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "num": (int, float), "str": (str,), "bool": (bool,),
                                       "list": (list,), "dict": (dict,)}

_RESOURCE_TYPES = {
    "id": "str", "object": "str", "created_at": "int", "completed_at": "int?", "status": "str",
    "incomplete_details": "dict?", "model": "str", "previous_response_id": "str?", "instructions": "str?",
    "output": "list", "error": "dict?", "tools": "list", "truncation": "str", "parallel_tool_calls": "bool",
    "text": "dict", "top_p": "num", "presence_penalty": "num", "frequency_penalty": "num", "top_logprobs": "int",
    "temperature": "num", "reasoning": "dict?", "user": "str?", "usage": "dict?", "max_output_tokens": "int?",
    "max_tool_calls": "int?", "store": "bool", "background": "bool", "service_tier": "str",
    "safety_identifier": "str?", "prompt_cache_key": "str?"}

_ITEMS = {
    "message": {"id": "str", "status": "str", "role": "str", "content": "list"},
    "function_call": {"id": "str", "call_id": "str", "name": "str", "arguments": "str", "status": "str"},
    "function_call_output": {"id": "str", "call_id": "str", "status": "str"},
    "reasoning": {"id": "str", "summary": "list"},
}

_PARTS = {"output_text": {"text": "str", "annotations": "list", "logprobs": "list"},
          "input_text": {"text": "str"}, "refusal": {"refusal": "str"}, "summary_text": {"text": "str"}}

_USAGE = {"input_tokens": "int", "output_tokens": "int", "total_tokens": "int", "input_tokens_details": "dict",
          "output_tokens_details": "dict"}

# the enums the schema gives (a field of an object that has it, by that object's kind)
_ITEM_STATUS = frozenset({"in_progress", "completed", "incomplete"})
_ENUMS: dict[str, dict[str, frozenset[str]]] = {
    "message": {"status": _ITEM_STATUS, "role": frozenset({"user", "assistant", "system", "developer"})},
    "function_call": {"status": _ITEM_STATUS},
    "function_call_output": {"status": _ITEM_STATUS},
    "response": {"truncation": frozenset({"auto", "disabled"}), "object": frozenset({"response"})},
}

_LIFECYCLE = ("response.created", "response.queued", "response.in_progress", "response.completed",
              "response.failed", "response.incomplete")
_IN_ITEM = {"item_id": "str", "output_index": "int"}
_IN_PART = _IN_ITEM | {"content_index": "int"}
_EVENTS: dict[str, dict[str, str]] = {
    **{name: {"response": "dict"} for name in _LIFECYCLE},
    "response.output_item.added": {"output_index": "int", "item": "dict"},
    "response.output_item.done": {"output_index": "int", "item": "dict"},
    "response.content_part.added": _IN_PART | {"part": "dict"},
    "response.content_part.done": _IN_PART | {"part": "dict"},
    "response.output_text.delta": _IN_PART | {"delta": "str", "logprobs": "list"},
    "response.output_text.done": _IN_PART | {"text": "str", "logprobs": "list"},
    "response.function_call_arguments.delta": _IN_ITEM | {"delta": "str"},
    "response.function_call_arguments.done": _IN_ITEM | {"arguments": "str"},
    "response.reasoning_summary_part.added": _IN_ITEM | {"summary_index": "int", "part": "dict"},
    "response.reasoning_summary_part.done": _IN_ITEM | {"summary_index": "int", "part": "dict"},
    "response.reasoning_summary_text.delta": _IN_ITEM | {"summary_index": "int", "delta": "str"},
    "response.reasoning_summary_text.done": _IN_ITEM | {"summary_index": "int", "text": "str"},
    "error": {"code": "str?", "message": "str", "param": "str?"},
}


def _fields(obj: Any, fields: dict[str, str], where: str) -> list[str]:
    """The problems of ``obj`` against ``fields`` (name to type, ``?`` where null is allowed)."""
    if not isinstance(obj, dict):
        return [f"{where}: not an object"]
    problems = []
    for name, kind in fields.items():
        if name not in obj:
            problems.append(f"{where}.{name}: required")
            continue
        value, nullable = obj[name], kind.endswith("?")
        if value is None and nullable:
            continue
        types = _TYPES[kind.rstrip("?")]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            problems.append(f"{where}.{name}: expected {kind}, got {value!r}")
    return problems


def _enums(obj: dict[str, Any], kind: str, where: str) -> list[str]:
    return [f"{where}.{name}: {obj[name]!r} is none of {sorted(values)}"
            for name, values in _ENUMS.get(kind, {}).items() if obj.get(name) not in values]


def _typed(obj: Any, kinds: dict[str, dict[str, str]], where: str) -> list[str]:
    kind = obj.get("type") if isinstance(obj, dict) else None
    if kind not in kinds:
        return [f"{where}.type: {kind!r} is none of {sorted(kinds)}"]
    return _fields(obj, kinds[kind], where) or _enums(obj, kind, where)


def item_problems(item: Any, where: str = "item") -> list[str]:
    """An output item against its ItemField schema: a message's content parts too."""
    problems = _typed(item, _ITEMS, where)
    if not problems and item["type"] == "message":
        for index, part in enumerate(item["content"]):
            problems += _typed(part, _PARTS, f"{where}.content[{index}]")
    return problems


def resource_problems(response: Any, where: str = "response") -> list[str]:
    """A response object against ResponseResource: its fields, types, items and usage."""
    problems = _fields(response, _RESOURCE_TYPES, where)
    if problems:
        return problems
    problems += _enums(response, "response", where)
    for index, item in enumerate(response["output"]):
        problems += item_problems(item, f"{where}.output[{index}]")
    if response["usage"] is not None:
        usage = response["usage"]
        problems += _fields(usage, _USAGE, f"{where}.usage") or (
            _fields(usage["input_tokens_details"], {"cached_tokens": "int"}, f"{where}.usage.input_tokens_details")
            + _fields(usage["output_tokens_details"], {"reasoning_tokens": "int"},
                      f"{where}.usage.output_tokens_details"))
    if response["error"] is not None:
        problems += _fields(response["error"], {"code": "str", "message": "str"}, f"{where}.error")
    if response["incomplete_details"] is not None:
        problems += _fields(response["incomplete_details"], {"reason": "str"}, f"{where}.incomplete_details")
    if not isinstance(response["tool_choice"], (str, dict)):
        problems.append(f"{where}.tool_choice: {response['tool_choice']!r}")
    return problems


def event_problems(event: Any) -> list[str]:
    """One streaming event against the schema of its type (an unknown type is a problem, as in the
    suite's union of event schemas), with the response, item or part it carries."""
    where = f"event {event.get('type') if isinstance(event, dict) else event!r}"
    problems = _typed(event, _EVENTS, where) + _fields(event, {"sequence_number": "int"}, where)
    if problems:
        return problems
    if "response" in event:
        problems += resource_problems(event["response"], f"{where}.response")
    if "item" in event:
        problems += item_problems(event["item"], f"{where}.item")
    if "part" in event and event["type"].startswith("response.content_part"):
        problems += _typed(event["part"], _PARTS, f"{where}.part")
    return problems
