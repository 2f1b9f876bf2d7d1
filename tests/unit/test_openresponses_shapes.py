"""Our reading of Open Responses' schemas (``tests.support.openresponses``), which the compliance cases of
``tests/e2e/test_open_responses_suite.py`` check every body and event with: what it refuses."""

import copy
from typing import Any

import pytest

from tests.support.openresponses import event_problems, resource_problems

USAGE = {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5, "input_tokens_details": {"cached_tokens": 0},
         "output_tokens_details": {"reasoning_tokens": 0}}
MESSAGE = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}]}
RESPONSE: dict[str, Any] = {
    "id": "resp_1", "object": "response", "created_at": 1, "completed_at": 2, "status": "completed",
    "incomplete_details": None, "model": "m", "previous_response_id": None, "instructions": None,
    "output": [MESSAGE], "error": None, "tools": [], "tool_choice": "auto", "truncation": "disabled",
    "parallel_tool_calls": False, "text": {"format": {"type": "text"}}, "top_p": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "top_logprobs": 0, "temperature": 1.0, "reasoning": None, "user": None,
    "usage": USAGE, "max_output_tokens": None, "max_tool_calls": None, "store": True, "background": False,
    "service_tier": "default", "metadata": {}, "safety_identifier": None, "prompt_cache_key": None}


def changed(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """RESPONSE with the field at ``path`` set to ``value`` (or removed, for ``...``)."""
    response = copy.deepcopy(RESPONSE)
    target: Any = response
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return response


def test_a_whole_response_and_its_events_pass() -> None:
    assert resource_problems(RESPONSE) == []
    assert event_problems({"type": "response.completed", "sequence_number": 9, "response": RESPONSE}) == []
    assert event_problems({"type": "response.output_item.done", "sequence_number": 8, "output_index": 0,
                           "item": MESSAGE}) == []
    assert event_problems({"type": "response.function_call_arguments.done", "sequence_number": 3,
                           "item_id": "fc_1", "output_index": 0, "arguments": "{}"}) == []


@pytest.mark.parametrize(("path", "value"), [
    (("max_tool_calls",), ...), (("reasoning",), ...), (("top_logprobs",), True), (("top_logprobs",), 0.5),
    (("created_at",), "1"), (("store",), None), (("truncation",), "middle"), (("object",), "chat.completion"),
    (("usage", "input_tokens_details"), ...), (("usage", "output_tokens_details", "reasoning_tokens"), None),
    (("output", 0, "status"), "done"), (("output", 0, "content", 0, "logprobs"), ...),
    (("output", 0, "type"), "image"), (("error",), {"message": "no code"}),
])
def test_each_departure_is_a_problem(path: tuple[Any, ...], value: Any) -> None:
    assert resource_problems(changed(path, value)) != []
    assert event_problems({"type": "response.created", "sequence_number": 0,
                           "response": changed(path, value)}) != []


@pytest.mark.parametrize("event", [
    {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "m", "output_index": 0,
     "content_index": 0, "delta": "x"},  # no logprobs
    {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0, "delta": "x",
     "logprobs": []},  # no sequence number
    {"type": "response.content_part.added", "sequence_number": 1, "item_id": "m", "output_index": 0,
     "content_index": 0, "part": {"type": "output_text", "text": ""}},  # a part without its arrays
    {"type": "response.function_call_arguments.delta", "sequence_number": 1, "output_index": 0, "delta": "{"},
    {"type": "response.output_text.annotation", "sequence_number": 1},  # no such event
])
def test_each_bad_event_is_a_problem(event: dict[str, Any]) -> None:
    assert event_problems(event) != []
