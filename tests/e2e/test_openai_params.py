"""What OpenAI clients send besides the prompt, driven with the official ``openai`` package against a
real API and tiny-random worker: ``parallel_tool_calls``, ``metadata`` (and its limits), ``user`` and
``safety_identifier``, ``prompt_cache_key``, ``service_tier``; a streamed chat call's first chunk;
``responses.delete`` and ``responses.input_items.list``; and the LMSP twins of each
(docs/protocol.md, "OpenAI compatibility").
"""

import asyncio
import json
import secrets
import time
from typing import Any

import httpx
import openai
import pydantic
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseItem

from lmsp_core.store import keys
from lmsp_core.store.tasks import queue
from tests.support import Api, Worker, assert_problem, body

MODEL = "tiny-random"
SERIAL = "tiny-serial"  # one task at a time (tests/conftest.py): a queue forms behind a long task
ITEMS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseItem)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                              "parameters": WEATHER}}
TWO_CITIES = "What is the weather in Paris and in Lima?"
LONG_PROMPT = "Tell me everything you know about the weather of Paris and of Lima, in detail, please."


def strict(response: Response) -> Response:
    return Response.model_validate(response.to_dict())


def calls_of(response: Response) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


# --- parallel_tool_calls ---------------------------------------------------------------------------


async def test_parallel_tool_calls_false_allows_one_call(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    """A forced call with room for many: asked for parallel calls, tiny-random makes several for this
    prompt (greedy decoding: always the same); with ``parallel_tool_calls: false`` (or without it)
    the grammar ends the answer after one."""
    fields: dict[str, Any] = {"model": MODEL, "input": TWO_CITIES, "tools": [TOOL], "tool_choice": "required",
                              "max_output_tokens": 120}
    several = strict(await sdk.responses.create(**fields, parallel_tool_calls=True))
    assert several.parallel_tool_calls is True and len(calls_of(several)) > 1
    one = strict(await sdk.responses.create(**fields, parallel_tool_calls=False))
    assert one.parallel_tool_calls is False and [item.type for item in one.output] == ["function_call"]
    assert one.status == "completed" and one.usage is not None and one.usage.output_tokens < 120
    default = strict(await sdk.responses.create(**fields))
    assert default.parallel_tool_calls is False and len(calls_of(default)) == 1
    # chat completions, and the LMSP extension that carries the setting
    chat = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TWO_CITIES}],
                                             tools=[CHAT_TOOL], tool_choice="required", parallel_tool_calls=False,
                                             max_completion_tokens=120)
    assert len(chat.choices[0].message.tool_calls or []) == 1 and chat.choices[0].finish_reason == "tool_calls"
    chat_several = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": TWO_CITIES}], tools=[CHAT_TOOL], tool_choice="required",
        parallel_tool_calls=True, max_completion_tokens=120)
    assert len(chat_several.choices[0].message.tool_calls or []) > 1
    lmsp = (await client.post("/lmsp/v1/responses", json=body(
        text=TWO_CITIES, tools=[TOOL], tool_choice="required", max_output_tokens=120,
        extensions={"x-parallel_tool_calls": True}))).json()
    assert [item["type"] for item in lmsp["output"]] == ["function_call"] * len(calls_of(several))
    refused = await client.post("/lmsp/v1/responses", json=body(extensions={"x-parallel_tool_calls": "no"}))
    assert_problem(refused, 400, "invalid_extension")


async def test_a_streamed_chat_call_starts_with_null_content(api: Api, tiny_worker: Worker) -> None:
    """OpenAI's first chunk of a call has ``"content": null`` (``""`` only for text); the SDK reads both
    as falsy, so the raw stream is checked."""
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
        async def first_delta(**fields: Any) -> dict[str, Any]:
            async with http.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "stream": True,
                    "max_tokens": 60, **fields}) as answer:
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        delta: dict[str, Any] = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                        return delta
            raise AssertionError("no chunk")

        assert await first_delta(tools=[CHAT_TOOL], tool_choice="required") == {"role": "assistant", "content": None}
        assert await first_delta() == {"role": "assistant", "content": ""}


# --- metadata, user, safety_identifier ---------------------------------------------------------------


async def test_metadata_round_trip(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    metadata = {"order": "A-17", "note": "x" * 512, "k" * 64: ""}
    direct = strict(await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=3, metadata=metadata))
    assert direct.metadata == metadata
    assert strict(await sdk.responses.retrieve(direct.id)).metadata == metadata
    background = strict(await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=3, background=True,
                                                   metadata=metadata))
    assert background.status == "queued" and background.metadata == metadata
    # the LMSP side: the stored response and the task carry it (an additional field, docs/protocol.md)
    while (stored := (await client.get(f"/lmsp/v1/responses/{background.id}")).json())["status"] == "in_progress":
        await asyncio.sleep(0.05)
    assert stored["metadata"] == metadata
    task = next(task for task in (await client.get("/lmsp/v1/tasks")).json()["data"]
                if task["response_id"] == background.id)
    assert task["metadata"] == metadata and task["response"]["metadata"] == metadata
    # chat completions echo it on the completion object
    chat = ChatCompletion.model_validate((await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, metadata={"a": "b"})).to_dict())
    assert chat.metadata == {"a": "b"} and chat.service_tier == "default"
    # on the LMSP routes as the x-metadata extension; without it, no field at all
    created = await client.post("/lmsp/v1/tasks", json=body(max_output_tokens=2, extensions={"x-metadata": {"a": "b"}}))
    assert created.json()["metadata"] == {"a": "b"}
    plain = (await client.post("/lmsp/v1/responses", json=body(max_output_tokens=2))).json()
    assert "metadata" not in plain


async def test_what_is_kept_outlives_the_task_record(sdk: openai.AsyncOpenAI, redis: aioredis.Redis) -> None:
    """The stored turn keeps the request's extensions: once the task's record has expired (deleted
    here), the response object still echoes metadata, user, tier and instructions."""
    response = await sdk.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=2,
                                          metadata={"a": "b"}, user="u-1", service_tier="flex")
    task_id = (await redis.get(keys.response(response.id))).decode()
    await redis.delete(keys.task(task_id))
    kept = strict(await sdk.responses.retrieve(response.id))
    assert (kept.metadata, kept.user, kept.service_tier, kept.instructions) == ({"a": "b"}, "u-1", "flex",
                                                                                "Be brief.")
    assert kept.output_text == response.output_text


async def test_metadata_limits_are_openais(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    cases: list[tuple[Any, str, str]] = [
        ({f"k{index}": "v" for index in range(17)}, "object_above_max_properties", "metadata"),
        ({"k" * 65: "v"}, "string_above_max_length", "metadata"),
        ({"k": "v" * 513}, "string_above_max_length", "metadata.k"),
        ({"k": 5}, "invalid_request", "metadata.k"),
    ]
    for metadata, code, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.responses.create(model=MODEL, input="Hi", metadata=metadata)
        assert (refused.value.code, refused.value.param) == (code, param), refused.value.body
        with pytest.raises(openai.BadRequestError) as chat:
            await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              metadata=metadata)
        assert (chat.value.code, chat.value.param) == (code, param)
    for name, limit in [("user", 256), ("safety_identifier", 128), ("prompt_cache_key", 64)]:
        with pytest.raises(openai.BadRequestError) as long:
            await sdk.responses.create(model=MODEL, input="Hi", **{name: "u" * (limit + 1)})
        assert (long.value.code, long.value.param) == ("string_above_max_length", name)
    too_many = await client.post("/lmsp/v1/responses", json=body(
        extensions={"x-metadata": {f"k{index}": "v" for index in range(17)}}))
    assert assert_problem(too_many, 400, "invalid_extension")["errors"][0]["key"] == "extensions.x-metadata"


async def test_user_and_safety_identifier_are_kept_not_logged(api: Api, tiny_worker: Worker,
                                                              sdk: openai.AsyncOpenAI) -> None:
    user, safety = f"user-canary-{secrets.token_hex(6)}", f"safety-canary-{secrets.token_hex(6)}"
    response = strict(await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, user=user,
                                                 safety_identifier=safety))
    assert (response.user, response.safety_identifier) == (user, safety)
    again = strict(await sdk.responses.retrieve(response.id))
    assert (again.user, again.safety_identifier) == (user, safety)
    chat = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                             user=user, safety_identifier=safety)
    assert chat.choices[0].finish_reason == "length"
    assert user not in api.output() + tiny_worker.output() and safety not in api.output() + tiny_worker.output()


# --- prompt_cache_key and service_tier ----------------------------------------------------------------


async def test_prompt_cache_key_scopes_prefix_reuse(sdk: openai.AsyncOpenAI) -> None:
    """Prefixes are reused within one owner and one key: the same prompt again under its key finds all
    of it but its last token cached, under another key (or none) not."""
    key, other = f"conversation-{secrets.token_hex(4)}", f"conversation-{secrets.token_hex(4)}"
    prompt = f"{LONG_PROMPT} ({secrets.token_hex(4)})"

    async def cached(**fields: Any) -> tuple[int, int]:
        response = strict(await sdk.responses.create(model=MODEL, input=prompt, max_output_tokens=2, **fields))
        assert response.prompt_cache_key == fields.get("prompt_cache_key")
        assert response.usage is not None
        return response.usage.input_tokens_details.cached_tokens, response.usage.input_tokens

    await cached(prompt_cache_key=key)
    hit, tokens = await cached(prompt_cache_key=key)
    assert hit == tokens - 1
    assert (await cached(prompt_cache_key=other))[0] == 0  # a scope that holds nothing yet
    assert (await cached())[0] < tokens - 1  # the owner's own scope never saw this prompt whole
    chat = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=2, prompt_cache_key=other)
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None


async def test_service_tier_is_echoed(sdk: openai.AsyncOpenAI) -> None:
    for asked, used in [(None, "default"), ("auto", "default"), ("default", "default"), ("flex", "flex"),
                        ("priority", "priority"), ("fast", "priority")]:
        fields = {} if asked is None else {"service_tier": asked}
        response = strict(await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **fields))
        assert response.service_tier == used, asked
        stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2, stream=True, **fields)
        chunks = [ChatCompletionChunk.model_validate(chunk.to_dict()) async for chunk in stream]
        assert {chunk.service_tier for chunk in chunks} == {used}
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.responses.create(model=MODEL, input="Hi", service_tier="scale")
    assert (refused.value.code, refused.value.param) == ("unsupported_value", "service_tier")


async def test_service_tier_orders_the_queue(api: Api, variant_worker: Worker, redis: aioredis.Redis) -> None:
    """Behind a long task (normal priority), direct responses queue by tier: ``flex`` (low) after it,
    the others (high, as every direct response) before it (docs/protocol.md, "Priorities")."""
    async with (httpx.AsyncClient(base_url=api.url, timeout=60) as http,
                openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk):
        blocker = (await http.post("/lmsp/v1/tasks", json=body(SERIAL, max_output_tokens=32000))).json()["id"]
        await _until(lambda: _status(http, blocker), "in_progress")
        answers = []
        for tier in ("flex", "default", "priority"):  # the order they come in
            answers.append(asyncio.create_task(sdk.responses.create(
                model=SERIAL, input="Hi", max_output_tokens=2, store=False, metadata={"tier": tier},
                **({} if tier == "default" else {"service_tier": tier}))))
            await _until(lambda: queue.depth(redis, SERIAL), len(answers) + 1)
        order = [(await redis.hget(keys.task(keys.task_of_job(job.decode())), "metadata")) or b'{"tier": "blocker"}'
                 for job in await redis.zrange(keys.queue(SERIAL), 0, -1)]
        assert [json.loads(tier)["tier"] for tier in order] == ["default", "priority", "blocker", "flex"]
        await http.post(f"/lmsp/v1/tasks/{blocker}/cancel")
        served = [await answer for answer in answers]
        assert [response.service_tier for response in served] == ["flex", "default", "priority"]


async def _status(http: httpx.AsyncClient, task_id: str) -> str:
    status: str = (await http.get(f"/lmsp/v1/tasks/{task_id}")).json()["status"]
    return status


async def _until(read: Any, wanted: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while await read() != wanted:
        assert time.monotonic() < deadline, f"never {wanted}"
        await asyncio.sleep(0.05)


# --- DELETE /v1/responses/{id} and input_items ----------------------------------------------------------


async def test_delete_a_response(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    first = await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    second = await sdk.responses.create(model=MODEL, input="And?", max_output_tokens=2, previous_response_id=first.id)
    assert await sdk.responses.delete(first.id) is None  # the SDK drops the body: OpenAI's deletion object
    for read in (sdk.responses.retrieve, sdk.responses.delete, sdk.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as gone:
            await read(first.id)
        assert gone.value.code == "response_not_found"
    # a conversation through a deleted turn cannot be continued: its context is gone
    with pytest.raises(openai.NotFoundError) as broken:
        await sdk.responses.create(model=MODEL, input="More?", previous_response_id=second.id)
    assert (broken.value.code, broken.value.param) == ("response_not_found", "previous_response_id")
    raw = await client.delete(f"/v1/responses/{second.id}")
    assert raw.status_code == 200 and raw.json() == {"id": second.id, "object": "response.deleted", "deleted": True}
    # the LMSP twin, with problem documents
    lmsp = (await client.post("/lmsp/v1/responses", json=body(max_output_tokens=2, store=True))).json()
    deleted = await client.delete(f"/lmsp/v1/responses/{lmsp['id']}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert_problem(await client.get(f"/lmsp/v1/responses/{lmsp['id']}"), 404, "response_not_found")
    assert_problem(await client.delete(f"/lmsp/v1/responses/{lmsp['id']}"), 404, "response_not_found")
    assert_problem(await client.delete("/lmsp/v1/responses/nonsense"), 404, "response_not_found")


async def test_deleting_a_running_response_cancels_it(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    running = await sdk.responses.create(model=MODEL, input="A long story.", max_output_tokens=1000, background=True)
    task = next(task for task in (await client.get("/lmsp/v1/tasks")).json()["data"]
                if task["response_id"] == running.id)
    await sdk.responses.delete(running.id)
    await _until(lambda: _status(client, task["id"]), "cancelled")
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(running.id)
    # the final write found no stored turn to fill: it stays deleted
    assert_problem(await client.get(f"/lmsp/v1/responses/{running.id}"), 404, "response_not_found")


async def test_input_items_in_pages(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "message", "role": "assistant", "content": "It is 21 C.", "id": "msg_mine"},
        {"role": "user", "content": [{"type": "input_text", "text": "And Lima?"}]},
    ]
    response = await sdk.responses.create(model=MODEL, input=items, instructions="Answer briefly.", tools=[TOOL],
                                          tool_choice="none", max_output_tokens=2)
    listed = [ITEMS.validate_python(item.to_dict()) async for item in sdk.responses.input_items.list(response.id)]
    # newest first, without the instructions, every item with an id (the client's where it sent one)
    assert [item.type for item in listed] == ["message", "message", "function_call_output", "function_call",
                                              "message", "message"]
    assert listed[0].content[0].text == "And Lima?" and listed[1].id == "msg_mine"
    assert listed[1].role == "assistant" and listed[1].content[0].type == "output_text"
    assert listed[-1].role == "system" and listed[-1].content[0].text == "Be brief."
    assert listed[3].call_id == "call_1" and listed[2].output == "21 C"
    assert len({item.id for item in listed}) == 6
    # pages of two, in order, by the SDK's auto-paging (``after`` the last id of each page)
    paged = [item async for item in sdk.responses.input_items.list(response.id, limit=2, order="asc")]
    assert [item.id for item in paged] == [item.id for item in reversed(listed)]
    page = (await client.get(f"/v1/responses/{response.id}/input_items",
                             params={"limit": 2, "order": "asc", "after": paged[1].id})).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [item["id"] for item in page["data"]] == [paged[2].id, paged[3].id]
    assert (page["first_id"], page["last_id"]) == (paged[2].id, paged[3].id)
    last = (await client.get(f"/v1/responses/{response.id}/input_items", params={"after": listed[-1].id})).json()
    assert last == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    for params, code, param in [({"after": "msg_nowhere"}, "invalid_cursor", "after"),
                                ({"include": ["message.output_text.logprobs"]}, "unsupported_value", "include"),
                                ({"limit": 101}, "invalid_request", "limit"), ({"order": "up"}, "invalid_request",
                                                                               "order")]:
        refused = await client.get(f"/v1/responses/{response.id}/input_items", params=params)
        assert refused.status_code == 400, params
        assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == (code, param), refused.json()
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.input_items.list("resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF")
    # an LMSP request's stored turn lists the same way
    lmsp = await client.post("/lmsp/v1/responses", json=body(text="Hello", max_output_tokens=2, store=True))
    assert lmsp.status_code == 200, lmsp.text
    [only] = [item async for item in sdk.responses.input_items.list(lmsp.json()["id"])]
    assert only.type == "message" and only.role == "user" and only.id.startswith("msg_")
