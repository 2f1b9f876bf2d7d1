"""Stored responses and conversations: store, GET /lmsp/v1/responses/{id}, previous_response_id."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
import redis.asyncio as aioredis

from lmsp_core import wire
from tests.backends import backend, client, eager_worker, make_token, redis, redis_settings, secure, served  # noqa: F401 (fixtures: both deployments)
from tests.support import (
    TOOLS,
    Api,
    RedisServer,
    TokenFactory,
    Worker,
    as_input,
    assert_problem,
    assert_valid_calls,
    bearer,
    body,
    collect,
    render,
    user_input,
)


async def test_stored_response_is_readable(client: httpx.AsyncClient) -> None:
    created = (await client.post("/lmsp/v1/responses", json=body(max_output_tokens=6, store=True))).json()
    stored = await client.get(f"/lmsp/v1/responses/{created['id']}")
    assert stored.status_code == 200
    assert stored.json() == created


async def test_unstored_unknown_and_malformed_ids_are_404(client: httpx.AsyncClient) -> None:
    unstored = (await client.post("/lmsp/v1/responses", json=body(max_output_tokens=2))).json()
    for response_id in (unstored["id"], "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF", "nonsense"):
        assert_problem(await client.get(f"/lmsp/v1/responses/{response_id}"), 404, "response_not_found")
    problem = assert_problem(await client.post("/lmsp/v1/responses", json=body(
        previous_response_id=unstored["id"])), 404, "response_not_found")
    assert unstored["id"] in problem["detail"]


async def test_streamed_and_task_responses_are_stored_once_final(client: httpx.AsyncClient) -> None:
    events = await collect(client, "POST", "/lmsp/v1/responses", json=body(max_output_tokens=5, stream=True,
                                                                          store=True))
    response_id = events[0].data["response_id"]
    stored = (await client.get(f"/lmsp/v1/responses/{response_id}")).json()
    assert stored["status"] == "incomplete"
    assert stored["output"][0]["content"][0]["text"] == "".join(
        e.data["delta"] for e in events if e.event == wire.TEXT_DELTA)

    task = (await client.post("/lmsp/v1/tasks", json=body(max_output_tokens=600, store=True))).json()
    early = (await client.get(f"/lmsp/v1/responses/{task['response_id']}")).json()
    assert early["status"] in ("in_progress", "incomplete")
    await collect(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events")
    final = (await client.get(f"/lmsp/v1/tasks/{task['id']}")).json()
    assert (await client.get(f"/lmsp/v1/responses/{task['response_id']}")).json() == final["response"]


async def test_a_chain_rebuilds_the_whole_context(client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    facts = ["The secret word is PLOVER.", "My cat is called Mitten.", "I live in Quito.", "Tell me a joke."]
    items: list[dict[str, Any]] = []
    previous = None
    for turn, text in enumerate(facts):
        request = body(text=text, max_output_tokens=8, store=True) | (
            {"previous_response_id": previous} if previous else {})
        response = (await client.post("/lmsp/v1/responses", json=request)).json()
        items += user_input(text)
        prompt, length = await render(redis, "tiny-random", items)
        assert response["usage"]["input_tokens"] == length, f"turn {turn + 1}"
        assert "PLOVER" in prompt
        items += as_input(response["output"])
        previous = response["id"]


async def test_tool_call_turns_in_a_chain(client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    question = "What is the weather in Hangzhou?"
    first = (await client.post("/lmsp/v1/responses", json=body(
        text=question, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
        store=True))).json()
    assert_valid_calls(first["output"], {"get_weather"})
    call = first["output"][0]
    result = {"type": "function_call_output", "call_id": call["call_id"],
              "output": json.dumps({"temperature_c": 17, "condition": "light rain"})}
    # the call is in the stored chain, not in this request's input: the call_id still matches
    second = await client.post("/lmsp/v1/responses", json={
        "model": "tiny-random", "input": [result], "previous_response_id": first["id"], "tools": TOOLS,
        "tool_choice": "none", "max_output_tokens": 6, "store": True})
    assert second.status_code == 200, second.text
    prompt, length = await render(redis, "tiny-random", [*user_input(question), call, result], TOOLS)
    assert second.json()["usage"]["input_tokens"] == length
    assert "light rain" in prompt and "get_weather" in prompt
    # an output whose call is in neither the chain nor the input
    stray = result | {"call_id": "call_nope"}
    assert_problem(await client.post("/lmsp/v1/responses", json={
        "model": "tiny-random", "input": [stray], "previous_response_id": second.json()["id"]}),
        400, "unmatched_call_id")


async def test_a_chain_beyond_the_context_window_is_refused(client: httpx.AsyncClient) -> None:
    previous = None
    for _ in range(3):  # 3 x ~600 tokens: fits, fits, then the fourth no longer does
        request = body(text="word " * 600, max_output_tokens=4, store=True) | (
            {"previous_response_id": previous} if previous else {})
        response = await client.post("/lmsp/v1/responses", json=request)
        assert response.status_code == 200, response.text
        previous = response.json()["id"]
    refused = await client.post("/lmsp/v1/responses", json=body(text="word " * 600, previous_response_id=previous))
    assert_problem(refused, 400, "context_length_exceeded")


async def test_store_is_ignored_without_the_capability(client: httpx.AsyncClient) -> None:
    task = (await client.post("/lmsp/v1/tasks", json=body(model="tiny-unserved", store=True))).json()
    assert_problem(await client.get(f"/lmsp/v1/responses/{task['response_id']}"), 404, "response_not_found")
    await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")


async def test_another_principal_cannot_read_or_continue(secure: httpx.AsyncClient,
                                                         make_token: TokenFactory) -> None:
    alice, _ = await make_token()
    bob, _ = await make_token()
    mine = (await secure.post("/lmsp/v1/responses", json=body(max_output_tokens=3, store=True),
                              headers=bearer(alice))).json()
    assert (await secure.get(f"/lmsp/v1/responses/{mine['id']}", headers=bearer(alice))).status_code == 200
    assert_problem(await secure.get(f"/lmsp/v1/responses/{mine['id']}", headers=bearer(bob)), 404,
                   "response_not_found")
    assert_problem(await secure.post("/lmsp/v1/responses", json=body(previous_response_id=mine["id"]),
                                     headers=bearer(bob)), 404, "response_not_found")
    continued = await secure.post("/lmsp/v1/responses", json=body(previous_response_id=mine["id"],
                                                                 max_output_tokens=2), headers=bearer(alice))
    assert continued.status_code == 200


@pytest_asyncio.fixture(scope="module")
async def short_lived(redis_server: RedisServer, models_file: str, tiny_worker: Worker) -> AsyncIterator[
        httpx.AsyncClient]:
    api = Api(redis_server.url, models_file=models_file, response_retention=2).start()
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
            yield http
    finally:
        api.stop()


async def test_stored_responses_expire(short_lived: httpx.AsyncClient) -> None:
    first = (await short_lived.post("/lmsp/v1/responses", json=body(max_output_tokens=2, store=True))).json()
    assert (await short_lived.get(f"/lmsp/v1/responses/{first['id']}")).status_code == 200
    await asyncio.sleep(2.5)
    assert_problem(await short_lived.get(f"/lmsp/v1/responses/{first['id']}"), 404, "response_not_found")
    assert_problem(await short_lived.post("/lmsp/v1/responses", json=body(previous_response_id=first["id"])),
                   404, "response_not_found")
