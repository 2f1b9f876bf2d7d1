"""Tool calls and structured output (6.1, 6.5), enforced by grammar-constrained decoding.

tiny-random has random weights: only the grammar can make its calls and JSON valid.
"""

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest

from lmsp_core import wire
from tests.support import PARAMETERS, SCHEMAS, TOOLS, assert_problem, assert_valid_calls, body, collect


def weather_request(**fields: Any) -> dict[str, Any]:
    return body(text="What is the weather in Hangzhou?", tools=[TOOLS[0]], **fields)


async def test_one_hundred_forced_tool_calls_validate(client: httpx.AsyncClient) -> None:
    choices: list[Any] = ["required", *({"type": "function", "name": tool["name"]} for tool in TOOLS)]
    gate = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        choice = choices[i % len(choices)]
        async with gate:
            response = await client.post("/lmsp/v1/responses", json=body(
                text=f"Request number {i}: use a tool.", tools=TOOLS, tool_choice=choice, max_output_tokens=120),
                timeout=300)
        assert response.status_code == 200, response.text
        data = response.json()
        allowed = {t["name"] for t in TOOLS} if choice == "required" else {choice["name"]}
        assert data["status"] == "completed"
        assert len(data["output"]) == 1  # one call per response
        assert_valid_calls(data["output"], allowed)

    await asyncio.gather(*(one(i) for i in range(100)))


async def test_one_hundred_json_schema_outputs_validate(client: httpx.AsyncClient) -> None:
    gate = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        schema = SCHEMAS[i % len(SCHEMAS)]
        async with gate:
            response = await client.post("/lmsp/v1/responses", json=body(
                text=f"Answer {i} as JSON.", max_output_tokens=400, temperature=(i % 3) * 0.5,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i % 5}", "schema": schema}}),
                timeout=300)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["status"] == "completed", data
        [message] = data["output"]
        assert message["type"] == "message"
        jsonschema.validate(json.loads(message["content"][0]["text"]), schema)

    await asyncio.gather(*(one(i) for i in range(100)))


async def test_a_streamed_call_is_announced_then_done(client: httpx.AsyncClient) -> None:
    events = await collect(client, "POST", "/lmsp/v1/responses",
                           json=weather_request(tool_choice="required", stream=True, max_output_tokens=60))
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    names = [e.event for e in events]
    assert names[0] == wire.CREATED and names[-1] in (wire.COMPLETED, wire.INCOMPLETE)
    assert wire.TEXT_DELTA not in names
    added, done = events[1], events[2]
    assert (added.event, done.event) == (wire.ITEM_ADDED, wire.ITEM_DONE)
    assert added.data["output_index"] == done.data["output_index"] == 0
    announced, item = added.data["item"], done.data["item"]
    assert announced == item | {"arguments": ""}
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    jsonschema.validate(json.loads(item["arguments"]), PARAMETERS["get_weather"])


async def test_auto_gives_a_message_or_valid_calls(client: httpx.AsyncClient) -> None:
    for i in range(6):
        response = await client.post("/lmsp/v1/responses", json=body(
            text=f"Maybe use a tool ({i}).", tools=TOOLS, max_output_tokens=80, temperature=1.0))
        output = response.json()["output"]
        if output[0]["type"] == "message":
            assert len(output) == 1 and not output[0]["content"][0]["text"].startswith("<tool_call>")
        else:
            assert_valid_calls(output, {t["name"] for t in TOOLS})


async def test_none_never_calls(client: httpx.AsyncClient) -> None:
    for i in range(4):
        response = await client.post("/lmsp/v1/responses", json=body(
            text=f"Do not use tools ({i}).", tools=TOOLS, tool_choice="none", max_output_tokens=30, temperature=1.0))
        [message] = response.json()["output"]
        assert message["type"] == "message"
        assert not message["content"][0]["text"].startswith("<tool_call>")


async def test_follow_up_with_function_call_output(client: httpx.AsyncClient) -> None:
    first = (await client.post("/lmsp/v1/responses", json=weather_request(tool_choice="required",
                                                                            max_output_tokens=60))).json()
    call = first["output"][0]
    follow_up = weather_request() | {"input": [
        *weather_request()["input"], call,
        {"type": "function_call_output", "call_id": call["call_id"],
         "output": json.dumps({"temperature_c": 17, "condition": "light rain"})}]}
    response = await client.post("/lmsp/v1/responses", json=follow_up | {"max_output_tokens": 10,
                                                                         "tool_choice": "none"})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["output"][0]["type"] == "message"
    assert data["usage"]["input_tokens"] > first["usage"]["input_tokens"]


TOOL_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("duplicate names", {"tools": [TOOLS[0], TOOLS[0]]}, "duplicate_tool_name"),
    ("parameters not an object schema",
     {"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "invalid_tool_schema"),
    ("invalid parameter type",
     {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object",
                                                                  "properties": {"x": {"type": "strin"}}}}]},
     "invalid_tool_schema"),
    ("broken pattern",
     {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
         "x": {"type": "string", "pattern": "[a-z"}}}}]}, "invalid_tool_schema"),
    ("bad tool name", {"tools": [{"type": "function", "name": "has space", "parameters": {}}]}, "invalid_request"),
    ("named choice not in tools", {"tools": [TOOLS[0]], "tool_choice": {"type": "function", "name": "add"}},
     "unknown_tool"),
    ("required without tools", {"tool_choice": "required"}, "invalid_tool_choice"),
    ("unknown tool_choice", {"tools": [TOOLS[0]], "tool_choice": "sometimes"}, "invalid_request"),
    ("output without its call",
     {"input": [*body()["input"], {"type": "function_call_output", "call_id": "call_x", "output": "{}"}]},
     "unmatched_call_id"),
    ("invalid json_schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "invalid_json_schema"),
    ("json_schema without a name",
     {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "invalid_request"),
]


@pytest.mark.parametrize(("case", "fields", "code"), TOOL_ERRORS, ids=[c[0] for c in TOOL_ERRORS])
async def test_invalid_tools_and_schemas(client: httpx.AsyncClient, case: str, fields: dict[str, Any],
                                         code: str) -> None:
    problem = assert_problem(await client.post("/lmsp/v1/responses", json=body() | fields), 400, code)
    assert problem["detail"]


async def test_models_report_tools_and_structured_output(client: httpx.AsyncClient) -> None:
    models = {m["id"]: m for m in (await client.get("/lmsp/v1/models")).json()["data"]}
    for model_id in ("tiny-random", "smollm2:135m-instruct"):
        assert {"tools", "structured_output"} <= set(models[model_id]["capabilities"])
    assert "tools" not in models["tiny-unserved"]["capabilities"]


# a free string argument: random weights write strings that never end unless the budget closes them
STRING_TOOL: dict[str, Any] = {
    "type": "function", "name": "get_weather", "description": "Get the weather at a place.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["location"]}}
STRING_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["title", "tags"],
    "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
BUDGET_CASES: list[tuple[str, dict[str, Any]]] = [
    ("forced call", {"tools": [STRING_TOOL], "tool_choice": "required"}),
    ("named call", {"tools": [STRING_TOOL, *TOOLS[1:]], "tool_choice": {"type": "function", "name": "get_weather"}}),
    ("json_schema", {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "t", "schema": STRING_SCHEMA}}}),
]


def smallest_budget(problem: dict[str, Any]) -> int:
    """The token count a max_output_tokens_too_small problem names as the shortest complete output."""
    return int(problem["detail"].rsplit("takes ", 1)[1].split(" ")[0])


@pytest.mark.parametrize(("case", "fields"), BUDGET_CASES, ids=[case for case, _ in BUDGET_CASES])
async def test_output_completes_within_its_budget(client: httpx.AsyncClient, case: str,
                                                  fields: dict[str, Any]) -> None:
    request = body(text="Where is it raining?", **fields)
    refused = assert_problem(await client.post("/lmsp/v1/responses", json=request | {"max_output_tokens": 1}), 400,
                             "max_output_tokens_too_small")
    smallest = smallest_budget(refused)
    assert 1 < smallest <= 24
    tasks = await client.post("/lmsp/v1/tasks", json=request | {"max_output_tokens": smallest - 1})
    assert smallest_budget(assert_problem(tasks, 400, "max_output_tokens_too_small")) == smallest
    for i, budget in enumerate(sorted({smallest, smallest + 1, 16, 24, 64})):
        if budget < smallest:
            too_small = await client.post("/lmsp/v1/responses", json=request | {"max_output_tokens": budget})
            assert_problem(too_small, 400, "max_output_tokens_too_small")
            continue
        sampled = {"temperature": 1.0, "extensions": {"x-seed": i}} if i % 2 else {}
        response = await client.post("/lmsp/v1/responses", json=request | {"max_output_tokens": budget} | sampled)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["status"] == "completed", (budget, data)
        assert data["usage"]["output_tokens"] <= budget
        if "tools" in fields:
            [call] = data["output"]
            assert call["type"] == "function_call" and call["name"] == "get_weather"
            jsonschema.validate(json.loads(call["arguments"]), STRING_TOOL["parameters"])
        else:
            [message] = data["output"]
            jsonschema.validate(json.loads(message["content"][0]["text"]), STRING_SCHEMA)


async def test_a_prompt_too_long_is_refused_without_a_worker(client: httpx.AsyncClient) -> None:
    # tiny-unserved never has a worker, so no card is published: the API reads its tokenizer from files
    request = body(model="tiny-unserved", text="word " * 2100)
    for route in ("/lmsp/v1/tasks", "/lmsp/v1/responses"):
        problem = assert_problem(await client.post(route, json=request), 400, "context_length_exceeded")
        assert "2048" in problem["detail"]
    # about 1,100 prompt tokens: room for 500 output tokens, not for 1,000
    shorter = body(model="tiny-unserved", text="word " * 1100, max_output_tokens=1000)
    assert_problem(await client.post("/lmsp/v1/tasks", json=shorter), 400, "context_length_exceeded")
    queued = await client.post("/lmsp/v1/tasks", json=shorter | {"max_output_tokens": 500})
    assert queued.status_code == 202
    assert (await client.post(f"/lmsp/v1/tasks/{queued.json()['id']}/cancel")).status_code == 200
