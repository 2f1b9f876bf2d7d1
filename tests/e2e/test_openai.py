"""The OpenAI compatibility layer, driven with the official ``openai`` package against a real API and
tiny-random worker: Responses (sync, stream, tools with a follow-up, json_schema, conversations,
background, a cut stream resumed with ``starting_after``, cancel), Chat Completions (sync, stream
with usage, tool calls), models, errors.

Every object and event the client receives is validated again with the package's own pydantic
models, so a field we forget or mistype fails here rather than in someone's application.
"""

import asyncio
import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from tests.proxy import CuttingProxy
from tests.support import Api, Worker, user_input

MODEL = "tiny-random"
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                              "parameters": WEATHER}}


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Lima"]
    sunny: bool


def strict(response: Response) -> Response:
    """The response, validated field by field with the openai package's model."""
    return Response.model_validate(response.to_dict())


async def events_of(stream: Any) -> list[Any]:
    events = [EVENTS.validate_python(event.to_dict()) async for event in stream]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def without_repeats(types: list[str]) -> list[str]:
    """Event types with each run of one type counted once (a run of text deltas, however cut)."""
    return [kind for index, kind in enumerate(types) if index == 0 or types[index - 1] != kind]


def text_of(events: list[Any]) -> str:
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


# --- Responses ---------------------------------------------------------------------------------------


async def test_a_response_with_instructions(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    response = strict(await sdk.responses.create(model=MODEL, input="Describe a queue.", instructions="Be brief.",
                                                 max_output_tokens=8))
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Be brief." and response.store and not response.background
    assert response.usage is not None and response.usage.output_tokens == 8
    assert response.output_text and response.output[0].type == "message"
    # the same generation as the LMSP route given the same context (greedy decoding)
    lmsp = await client.post("/lmsp/v1/responses", json={"model": MODEL, "max_output_tokens": 8, "input": [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
        *user_input("Describe a queue.")]})
    assert lmsp.json()["output"][0]["content"][0]["text"] == response.output_text
    # stored by default, as on OpenAI
    again = strict(await sdk.responses.retrieve(response.id))
    assert again.output_text == response.output_text and again.status == "incomplete"
    assert again.completed_at is not None


async def test_a_streamed_response(sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.responses.create(model=MODEL, input="Tell me about the sea.", max_output_tokens=12,
                                        stream=True)
    events = await events_of(stream)
    types = [event.type for event in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    final = events[-1].response
    assert final.output_text == text_of(events) == events[-4].text
    assert final.usage.output_tokens == 12 and {event.response.id for event in (events[0], events[1])} == {final.id}
    # the SDK's own stream helper accumulates the same response (its text may be cut into other deltas:
    # a delta holds the tokens of one flush interval, docs/protocol.md)
    async with sdk.responses.stream(model=MODEL, input="Tell me about the sea.", max_output_tokens=12) as helper:
        helped = [event async for event in helper]
    assert without_repeats([event.type for event in helped]) == without_repeats(types)
    assert helped[-1].response.output_text == final.output_text


async def test_tools_then_the_function_output(sdk: openai.AsyncOpenAI) -> None:
    first = strict(await sdk.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[TOOL],
                                              tool_choice={"type": "function", "name": "get_weather"}))
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = json.dumps({"temperature": 21})
    # continued on the server (previous_response_id) ...
    follow = strict(await sdk.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[TOOL], tool_choice="none", max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": answer}]))
    assert follow.previous_response_id == first.id and follow.output[0].type == "message"
    # ... and statelessly, with the call item sent back as the SDK returned it: the same context
    stateless = strict(await sdk.responses.create(
        model=MODEL, store=False, tools=[TOOL], tool_choice="none", max_output_tokens=6,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call,
               {"type": "function_call_output", "call_id": call.call_id, "output": answer}]))
    assert stateless.output_text == follow.output_text and not stateless.store
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(stateless.id)


async def test_a_streamed_call(sdk: openai.AsyncOpenAI) -> None:
    events = await events_of(await sdk.responses.create(model=MODEL, input="Weather in Lima?", tools=[TOOL],
                                                        tool_choice="required", stream=True))
    types = [event.type for event in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.arguments == "" and events[5].item.arguments == events[4].arguments == events[3].delta
    jsonschema.validate(json.loads(events[4].arguments), WEATHER)


async def test_json_schema_output(sdk: openai.AsyncOpenAI) -> None:
    response = strict(await sdk.responses.create(
        model=MODEL, input="Forecast for Lima, as JSON.",
        text={"format": {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}}))
    assert response.status == "completed" and response.text is not None
    assert response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    any_object = strict(await sdk.responses.create(model=MODEL, input="Some JSON.", max_output_tokens=40,
                                                   text={"format": {"type": "json_object"}}))
    assert any_object.text is not None and any_object.text.format.type == "json_object"
    assert any_object.status != "completed" or isinstance(json.loads(any_object.output_text), dict)
    # the SDK's structured-output helper: a pydantic model in, a parsed object out
    parsed = await sdk.responses.parse(model=MODEL, input="Forecast for Paris.", text_format=Forecast)
    assert isinstance(parsed.output_parsed, Forecast)


async def test_previous_response_id_carries_the_conversation(sdk: openai.AsyncOpenAI) -> None:
    first = strict(await sdk.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=5))
    second = strict(await sdk.responses.create(model=MODEL, previous_response_id=first.id, input="My name?",
                                               max_output_tokens=6))
    assert second.previous_response_id == first.id
    by_hand = await sdk.responses.create(model=MODEL, store=False, max_output_tokens=6, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "My name?"}])
    assert second.output_text == by_hand.output_text
    # the same context again: all of it but its last token is still in the worker's KV slot
    assert by_hand.usage is not None and second.usage is not None
    assert by_hand.usage.input_tokens == second.usage.input_tokens
    assert by_hand.usage.input_tokens_details.cached_tokens == by_hand.usage.input_tokens - 1
    fresh = await sdk.responses.create(model=MODEL, store=False, input="My name?", max_output_tokens=6)
    assert fresh.output_text != second.output_text  # the context made the difference


async def test_a_background_response_is_a_task(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    queued = strict(await sdk.responses.create(model=MODEL, input="A long story.", max_output_tokens=40,
                                               background=True))
    assert queued.background and queued.status in ("queued", "in_progress") and not queued.output
    events = await events_of(await sdk.responses.retrieve(queued.id, stream=True))
    assert events[0].response.status == "queued" and events[-1].type == "response.incomplete"
    tasks = (await client.get("/lmsp/v1/tasks", params={"limit": 100})).json()["data"]
    [task] = [task for task in tasks if task["response_id"] == queued.id]
    assert task["status"] == "incomplete"
    # one log, two renderings: the LMSP events of the task carry the same text
    lmsp = await client.get(f"/lmsp/v1/tasks/{task['id']}/events")
    deltas = [json.loads(line[6:])["delta"] for line in lmsp.text.splitlines()
              if line.startswith("data: ") and '"delta"' in line]
    assert "".join(deltas) == text_of(events) == strict(await sdk.responses.retrieve(queued.id)).output_text


async def test_a_cut_stream_resumes_after_its_last_event(api: Api, sdk: openai.AsyncOpenAI,
                                                         eager_worker: Worker) -> None:
    """A background stream cut mid-body (tests/proxy.py) and resumed with ``starting_after``: the events
    of an uninterrupted reading, each once, and the text of an uninterrupted run. (A worker killed
    under a background response: tests/e2e/test_reclaim.py.)"""
    # a worker that appends after every step: many small events, so that the cut falls mid-stream
    request: dict[str, Any] = {"model": "tiny-eager", "input": "Tell me about the sea.", "max_output_tokens": 160}
    reference = (await sdk.responses.create(**request)).output_text
    seen: list[Any] = []
    with CuttingProxy(api.port, cut_after=7000, match=b"/v1/responses") as proxy:
        flaky = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            stream = await flaky.responses.create(**request, background=True, stream=True)
            with pytest.raises(openai.APIConnectionError):
                async for event in stream:
                    seen.append(EVENTS.validate_python(event.to_dict()))
        finally:
            await flaky.close()
    assert proxy.cuts == 1 and seen and seen[-1].type != "response.incomplete"
    response_id, last = seen[0].response.id, seen[-1].sequence_number
    rest = [EVENTS.validate_python(event.to_dict()) async for event in await sdk.responses.retrieve(
        response_id, stream=True, starting_after=last)]
    whole = await events_of(await sdk.responses.retrieve(response_id, stream=True))
    assert [event.to_dict() for event in seen + rest] == [event.to_dict() for event in whole]  # gapless, each once
    assert text_of(seen + rest) == reference == (await sdk.responses.retrieve(response_id)).output_text
    # the SDK's own resuming helper (it reads from the start and drops what it had)
    async with sdk.responses.stream(response_id=response_id, starting_after=last) as helper:
        assert [event.sequence_number async for event in helper] == [event.sequence_number for event in rest]


async def test_cancel_a_background_response(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    started = await sdk.responses.create(model=MODEL, input="Count to a million.", max_output_tokens=1000,
                                         background=True, stream=True)
    response_id = ""
    async for event in started:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            break
    await started.close()  # a background response outlives its stream
    cancelled = strict(await sdk.responses.cancel(response_id))
    while cancelled.status == "in_progress":  # the call waits 3 s for the worker: longer on a loaded machine
        await asyncio.sleep(0.1)
        cancelled = strict(await sdk.responses.retrieve(response_id))
    assert cancelled.status == "cancelled" and cancelled.usage is not None
    assert 0 < cancelled.usage.output_tokens < 1000
    again = strict(await sdk.responses.cancel(cancelled.id))  # idempotent
    assert again.status == "cancelled" and again.output_text == cancelled.output_text
    events = await events_of(await sdk.responses.retrieve(cancelled.id, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    direct = await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.responses.cancel(direct.id)
    assert refused.value.code == "not_cancellable"


# --- Chat Completions and models -----------------------------------------------------------------------


async def test_a_chat_completion_and_its_stream(sdk: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Describe a queue."}]
    completion = ChatCompletion.model_validate(
        (await sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=7)).to_dict())
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    stream = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [ChatCompletionChunk.model_validate(chunk.to_dict()) async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage  # the usage chunk comes last
    assert not chunks[-1].choices and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (completion.usage.prompt_tokens, 7)
    # the same prompt again: all of it but its last token was still in the worker's KV slot
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert {chunk.id for chunk in chunks} == {chunks[0].id}


async def test_a_chat_tool_call_and_its_result(sdk: openai.AsyncOpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Lima?"}]
    called = await sdk.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_TOOL],
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ChatCompletion.model_validate(called.to_dict())
    [choice] = called.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # the assistant message goes back as the SDK returned it, then the tool's result
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    answer = await sdk.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_TOOL], tool_choice="none",
                                               max_tokens=5)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    streamed = await sdk.chat.completions.create(model=MODEL, messages=messages[:1], tools=[CHAT_TOOL],
                                                 tool_choice="required", stream=True)
    chunks = [chunk async for chunk in streamed]
    calls = [tool for chunk in chunks for tool in chunk.choices[0].delta.tool_calls or ()]
    assert [tool.function.name for tool in calls] == ["get_weather"] and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_models(sdk: openai.AsyncOpenAI) -> None:
    listed = [model.id async for model in sdk.models.list()]
    assert MODEL in listed and "smollm2:135m-instruct" in listed
    assert (await sdk.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


# --- errors --------------------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("an unknown parameter", {"prompt": {"id": "pmpt_1"}}, 400, "unsupported_parameter", "prompt"),
    ("an unknown nested parameter", {"text": {"verbosity": "low"}}, 400, "unsupported_parameter", "text.verbosity"),
    ("a value with no effect here", {"truncation": "auto"}, 400, "unsupported_value", "truncation"),
    ("a wrong type", {"max_output_tokens": "many"}, 400, "invalid_request", "max_output_tokens"),
    ("out of range", {"temperature": 3}, 400, "invalid_request", "temperature"),
    ("an image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "unsupported_content_type", "input[0].content[0].type"),
    ("a hosted tool", {"tools": [{"type": "web_search"}]}, 400, "unsupported_value", "tools[0].type"),
    ("an item reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "unsupported_value",
     "input[0].type"),
    ("an unknown model", {"model": "no-such-model"}, 404, "model_not_found", "model"),
    ("an unknown previous response", {"previous_response_id": "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"}, 404,
     "response_not_found", "previous_response_id"),
    ("background without store", {"background": True, "store": False}, 400, "unsupported_value", "background"),
    ("too many tokens", {"max_output_tokens": 5000}, 400, "max_output_tokens_too_large", "max_output_tokens"),
]


@pytest.mark.parametrize(("fields", "status", "code", "param"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
async def test_bad_requests_get_openai_errors(sdk: openai.AsyncOpenAI, fields: dict[str, Any], status: int,
                                              code: str, param: str | None) -> None:
    with pytest.raises(openai.APIStatusError) as error:
        await sdk.responses.create(**({"model": MODEL, "input": "Hi"} | fields))
    assert error.value.status_code == status and error.value.code == code and error.value.param == param
    body = error.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")


async def test_chat_parameters_are_refused_by_name(sdk: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    for fields, param in [({"n": 2}, "n"), ({"logit_bias": {"1": 5}}, "logit_bias"), ({"audio": {}}, "audio"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
                           "response_format.json_schema.name"),
                          ({"stream_options": {"include_usage": True}}, "stream_options"),
                          ({"seed": -1}, "seed"), ({"top_p": 0}, "top_p"), ({"stop": ["a"] * 5}, "stop")]:
        with pytest.raises(openai.BadRequestError) as error:
            await sdk.chat.completions.create(model=MODEL, messages=messages, **fields)
        assert error.value.param == param, (fields, error.value.body)
        assert "x-" not in error.value.message  # the parameter, not the extension that carries it
    with pytest.raises(openai.BadRequestError) as image:
        await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert image.value.code == "unsupported_content_type" and image.value.param == "messages[0].content[0].type"


async def test_route_errors_are_openai_errors(client: httpx.AsyncClient) -> None:
    for method, path, status in [("GET", "/v1/nowhere", 404), ("PUT", "/v1/responses/resp_x", 405),
                                 ("GET", "/v1/responses/resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF", 404),
                                 ("GET", "/v1/responses/nonsense", 404)]:
        response = await client.request(method, path)
        assert response.status_code == status and response.headers["content-type"] == "application/json"
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    malformed = await client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    # LMSP routes keep their problem documents, and /v1 ignores the LMSP-Version header
    assert (await client.get("/lmsp/v1/nowhere")).headers["content-type"] == "application/problem+json"
    assert (await client.get("/v1/models", headers={"LMSP-Version": "9"})).status_code == 200


async def test_a_reasoning_model(api: Api, variant_worker: Worker) -> None:
    """tiny-reasoning (tests/conftest.py): its reasoning item's summary streams as OpenAI's reasoning
    summary events, and chat completions carry it as ``reasoning_content``."""
    async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as sdk:
        events = await events_of(await sdk.responses.create(model="tiny-reasoning", input="Think.",
                                                            max_output_tokens=40, stream=True))
        types = [event.type for event in events]
        assert types[2:5] == ["response.output_item.added", "response.reasoning_summary_part.added",
                              "response.reasoning_summary_text.delta"]
        done = types.index("response.reasoning_summary_text.done")
        assert types[done:done + 3] == ["response.reasoning_summary_text.done",
                                        "response.reasoning_summary_part.done", "response.output_item.done"]
        final = events[-1].response
        reasoning, message = final.output
        assert reasoning.type == "reasoning" and message.type == "message"
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
        assert reasoning.summary[0].text == thought == events[done].text and final.output_text == text_of(events)
        assert final.usage.output_tokens_details.reasoning_tokens > 0
        chat = await sdk.chat.completions.create(model="tiny-reasoning", max_tokens=40,
                                                 messages=[{"role": "user", "content": "Think."}])
        assert chat.choices[0].message.model_dump()["reasoning_content"] == thought
        assert chat.choices[0].message.content == final.output_text
