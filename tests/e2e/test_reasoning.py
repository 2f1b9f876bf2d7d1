"""Reasoning models (6.2 ``reasoning`` items): a reasoning item, then the answer.

``tiny-reasoning`` (tests/conftest.py) has random weights and a chat template that opens the
section at the generation prompt: its section never closes by itself, so the reasoning budget
closes it, deterministically, and the answer follows.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from tokenizers import Tokenizer

from lmsp_core.requests.catalog import ReasoningFormat
from lmsp_core.requests.closing import closing_tokens
from lmsp_core.store import registry
from lmsp_core.wire import ids
from tests.support import REASONING_BUDGET, Api, Worker, assert_problem, body, collect

MODEL = "tiny-reasoning"
MAX_TOKENS = 48


@pytest_asyncio.fixture
async def client(api: Api, variant_worker: Worker) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
        yield http


async def closing_length(redis: aioredis.Redis) -> int:
    """Tokens of the text the service appends to close a section, up to the end of the end marker
    (reasoning tokens end there; the whitespace after it counts as answer)."""
    card = await registry.load_card(redis, MODEL)
    assert card is not None
    tokenizer, reasoning = Tokenizer.from_str(card.tokenizer_json), ReasoningFormat()
    tokens = closing_tokens(tokenizer, reasoning)
    return next(n for n in range(1, len(tokens) + 1) if reasoning.end in tokenizer.decode(tokens[:n]))


def assert_reasoning_then_message(output: list[dict[str, Any]]) -> tuple[str, str]:
    """The reasoning text and the message text of a reasoning response."""
    assert [item["type"] for item in output] == ["reasoning", "message"]
    reasoning, message = output
    assert ids.is_id(reasoning["id"], ids.REASONING) and ids.is_id(message["id"], ids.MESSAGE)
    assert set(reasoning) == {"id", "type", "summary"}
    assert [part["type"] for part in reasoning["summary"]] == ["summary_text"]
    thought, answer = reasoning["summary"][0]["text"], message["content"][0]["text"]
    for marker in ("<think>", "</think>"):
        assert marker not in thought and marker not in answer
    assert thought == thought.strip() and answer == answer.lstrip()
    return thought, answer


async def test_sync_response_has_reasoning_then_message(client: httpx.AsyncClient,
                                                        redis: aioredis.Redis) -> None:
    response = await client.post("/lmsp/v1/responses", json=body(MODEL, max_output_tokens=MAX_TOKENS))
    assert response.status_code == 200, response.text
    data = response.json()
    thought, answer = assert_reasoning_then_message(data["output"])
    assert thought and answer
    usage = data["usage"]
    # the budget's tokens, then the forced end of the section, then the answer up to the limit
    reasoning_tokens = REASONING_BUDGET + await closing_length(redis)
    assert usage["output_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    assert data["status"] == "incomplete" and usage["output_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + MAX_TOKENS


async def test_stream_matches_sync(client: httpx.AsyncClient) -> None:
    request = body(MODEL, text="Stream it", max_output_tokens=MAX_TOKENS)
    sync = (await client.post("/lmsp/v1/responses", json=request)).json()
    events = await collect(client, "POST", "/lmsp/v1/responses", json={**request, "stream": True})
    names = [event.event for event in events]
    assert [event.id for event in events] == list(range(1, len(events) + 1))
    first_text = names.index("response.output_text.delta")
    assert names[:3] == ["response.created", "response.output_item.added", "response.reasoning_summary_text.delta"]
    assert names[first_text - 2:first_text] == ["response.output_item.done", "response.output_item.added"]
    assert set(names[2:first_text - 2]) == {"response.reasoning_summary_text.delta"}
    assert names[-2:] == ["response.output_item.done", "response.incomplete"]
    added = [event.data for event in events if event.event == "response.output_item.added"]
    done = [event.data for event in events if event.event == "response.output_item.done"]
    assert added[0]["item"] == {"id": done[0]["item"]["id"], "type": "reasoning", "summary": []}
    assert [item["output_index"] for item in added] == [item["output_index"] for item in done] == [0, 1]
    thought = "".join(e.data["delta"] for e in events if e.event == "response.reasoning_summary_text.delta")
    answer = "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")
    assert all(e.data["item_id"] == done[0]["item"]["id"] for e in events
               if e.event == "response.reasoning_summary_text.delta")
    streamed = [done[0]["item"], done[1]["item"]]
    assert assert_reasoning_then_message(streamed) == (thought, answer)
    assert assert_reasoning_then_message(sync["output"]) == (thought, answer)
    counts = ("input_tokens", "output_tokens", "total_tokens", "output_tokens_details")  # the cached ones differ
    assert {key: events[-1].data["usage"][key] for key in counts} == {key: sync["usage"][key] for key in counts}


async def test_budget_extension(client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    """``x-reasoning_budget`` replaces the model's budget; 0 closes the section at once."""
    closing = await closing_length(redis)
    for budget in (0, 5):
        response = await client.post("/lmsp/v1/responses", json=body(
            MODEL, max_output_tokens=MAX_TOKENS, extensions={"x-reasoning_budget": budget}))
        data = response.json()
        assert data["usage"]["output_tokens_details"] == {"reasoning_tokens": budget + closing}
        assert [item["type"] for item in data["output"]] == ["reasoning", "message"]
        assert (data["output"][0]["summary"] == []) == (budget == 0)


async def test_section_longer_than_the_output(client: httpx.AsyncClient) -> None:
    """When max_output_tokens ends the output inside the section, the message is empty."""
    response = await client.post("/lmsp/v1/responses", json=body(MODEL, max_output_tokens=REASONING_BUDGET - 4))
    data = response.json()
    assert data["status"] == "incomplete"
    assert data["usage"]["output_tokens_details"] == {"reasoning_tokens": REASONING_BUDGET - 4}
    assert [item["type"] for item in data["output"]] == ["reasoning", "message"]
    assert data["output"][1]["content"] == [{"type": "output_text", "text": ""}]


async def test_structured_output_after_reasoning(client: httpx.AsyncClient) -> None:
    """The json_schema grammar applies to the answer only: the reasoning before it is free."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"]}
    response = await client.post("/lmsp/v1/responses", json=body(
        MODEL, max_output_tokens=200, response_format={"type": "json_schema",
                                                       "json_schema": {"name": "trip", "schema": schema}}))
    data = response.json()
    assert data["status"] == "completed", data
    thought, answer = assert_reasoning_then_message(data["output"])
    assert thought
    jsonschema.validate(json.loads(answer), schema)


async def test_a_small_budget_closes_the_section_in_time_for_the_answer(client: httpx.AsyncClient) -> None:
    """With less room than the reasoning budget needs, the section closes early and the JSON completes."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    request = body(MODEL, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    refused = assert_problem(await client.post("/lmsp/v1/responses", json=request | {"max_output_tokens": 1}),
                             400, "max_output_tokens_too_small")
    smallest = int(refused["detail"].rsplit("takes ", 1)[1].split(" ")[0])
    for budget in (smallest, REASONING_BUDGET):
        response = await client.post("/lmsp/v1/responses", json=request | {"max_output_tokens": budget})
        data = response.json()
        assert data["status"] == "completed", (budget, data)
        assert [item["type"] for item in data["output"]] == ["reasoning", "message"]
        assert (data["output"][0]["summary"] == []) == (budget == smallest)  # no room to reason at all
        jsonschema.validate(json.loads(data["output"][1]["content"][0]["text"]), schema)


async def test_tool_call_after_reasoning(client: httpx.AsyncClient) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}},
                           "required": ["city"]}}
    response = await client.post("/lmsp/v1/responses", json=body(
        MODEL, max_output_tokens=200, tools=[tool], tool_choice="required"))
    data = response.json()
    assert data["status"] == "completed", data
    assert data["output"][0]["type"] == "reasoning"
    calls = data["output"][1:]
    assert calls and all(item["type"] == "function_call" and item["name"] == "get_weather" for item in calls)
    assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Lima")


async def test_reasoning_items_in_input(client: httpx.AsyncClient) -> None:
    """A reasoning item sent back is accepted and rendered by the template (here into the prompt)."""
    first = (await client.post("/lmsp/v1/responses", json=body(MODEL, max_output_tokens=MAX_TOKENS))).json()
    turn = [*body(MODEL)["input"], *first["output"],
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And then?"}]}]
    without = [item for item in turn if item["type"] != "reasoning"]
    counts = []
    for items in (turn, without):
        response = await client.post("/lmsp/v1/responses", json={"model": MODEL, "input": items,
                                                                  "max_output_tokens": 4})
        assert response.status_code == 200, response.text
        counts.append(response.json()["usage"]["input_tokens"])
    assert counts[0] > counts[1]


async def test_budget_on_other_models_is_ignored(client: httpx.AsyncClient, tiny_worker: Worker) -> None:
    response = await client.post("/lmsp/v1/responses", json=body(
        max_output_tokens=4, extensions={"x-reasoning_budget": 3}))
    assert response.status_code == 200
    assert response.headers["LMSP-Ignored-Extensions"] == "x-reasoning_budget"
    assert [item["type"] for item in response.json()["output"]] == ["message"]
    assert "output_tokens_details" not in response.json()["usage"]


@pytest.mark.parametrize("budget", [-1, 1.5, "8", None])
async def test_bad_budget(client: httpx.AsyncClient, budget: Any) -> None:
    response = await client.post("/lmsp/v1/responses", json=body(MODEL, extensions={"x-reasoning_budget": budget}))
    assert_problem(response, 400, "invalid_extension")


async def test_models_list_reasoning(client: httpx.AsyncClient) -> None:
    model = (await client.get(f"/lmsp/v1/models/{MODEL}")).json()
    assert "reasoning" in model["capabilities"]
