"""What Open Responses and OpenAI clients need of ``/v1/responses`` beyond generating: every field of the
response object that Open Responses' ``ResponseResource`` requires (bodies and lifecycle events),
``POST /v1/responses/input_tokens`` (driven with the official ``openai`` package), the routes beside
``/v1/responses/{id}`` (docs/protocol.md, "OpenAI compatibility")."""

from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import InputTokenCountResponse

from tests.support import RESPONSE_RESOURCE, collect, event_problems, resource_problems

MODEL = "tiny-random"
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def assert_resource(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` has every field ResponseResource requires, the five this service once lacked typed as
    the schema says."""
    assert set(response) >= RESPONSE_RESOURCE, sorted(RESPONSE_RESOURCE - set(response))
    assert response["presence_penalty"] == 0 and response["frequency_penalty"] == 0
    assert isinstance(response["top_logprobs"], int) and not isinstance(response["top_logprobs"], bool)
    assert response["reasoning"] is None and response["max_tool_calls"] is None
    return response


# --- the response object ------------------------------------------------------------------------------


async def test_bodies_have_every_required_field(client: httpx.AsyncClient) -> None:
    created = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3})
    assert created.status_code == 200, created.text
    response = assert_resource(created.json())
    assert response["top_logprobs"] == 0 and resource_problems(response) == []
    retrieved = await client.get(f"/v1/responses/{response['id']}")
    assert assert_resource(retrieved.json())["status"] == response["status"]
    queued = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                                       "background": True})
    assert assert_resource(queued.json())["status"] == "queued" and resource_problems(queued.json()) == []
    cancelled = await client.post(f"/v1/responses/{queued.json()['id']}/cancel")
    assert resource_problems(assert_resource(cancelled.json())) == []


async def test_every_lifecycle_event_has_a_whole_response(client: httpx.AsyncClient) -> None:
    events = await collect(client, "POST", "/v1/responses", json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True, "top_logprobs": 2,
        "include": ["message.output_text.logprobs"], "presence_penalty": 0, "frequency_penalty": 0.0})
    assert [problem for event in events for problem in event_problems(event.data)] == []
    lifecycle = [event for event in events if "response" in event.data]
    assert [event.event for event in lifecycle] == ["response.created", "response.in_progress",
                                                    "response.incomplete"]
    for event in lifecycle:
        assert assert_resource(event.data["response"])["top_logprobs"] == 2  # echoed from the request
    # a background response's stream, read again by id, carries the same fields
    queued = (await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                        "background": True})).json()
    replayed = await collect(client, "GET", f"/v1/responses/{queued['id']}", params={"stream": "true"})
    assert [problem for event in replayed for problem in event_problems(event.data)] == []
    for event in replayed:
        if "response" in event.data:
            assert_resource(event.data["response"])


async def test_the_sdk_reads_the_echoed_options(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=3, top_logprobs=1,
                                          include=["message.output_text.logprobs"],
                                          extra_body={"presence_penalty": 0, "frequency_penalty": 0})
    assert response.top_logprobs == 1 and response.reasoning is None and response.max_tool_calls is None
    assert_resource(response.to_dict(exclude_unset=False))


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
async def test_a_penalty_other_than_zero_is_refused(sdk: openai.AsyncOpenAI, penalty: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=3, extra_body={penalty: 0.5})
    assert error.value.code == "unsupported_value" and error.value.param == penalty


# --- POST /v1/responses/input_tokens ------------------------------------------------------------------


async def test_input_tokens_are_the_usage_a_response_reports(sdk: openai.AsyncOpenAI) -> None:
    counted = await sdk.responses.input_tokens.count(model=MODEL, input="Describe a queue.",
                                                     instructions="Be brief.")
    assert isinstance(counted, InputTokenCountResponse) and counted.object == "response.input_tokens"
    response = await sdk.responses.create(model=MODEL, input="Describe a queue.", instructions="Be brief.",
                                          max_output_tokens=1)
    assert response.usage is not None and counted.input_tokens == response.usage.input_tokens
    # tools are part of the prompt: counted as the model's template (or the tools block) renders them
    with_tools = await sdk.responses.input_tokens.count(model=MODEL, input="Describe a queue.",
                                                        instructions="Be brief.", tools=[TOOL])
    called = await sdk.responses.create(model=MODEL, input="Describe a queue.", instructions="Be brief.",
                                        tools=[TOOL], tool_choice="none", max_output_tokens=1)
    assert called.usage is not None and with_tools.input_tokens == called.usage.input_tokens
    assert with_tools.input_tokens > counted.input_tokens
    # the next turn of a conversation counts its earlier turns
    follow = await sdk.responses.input_tokens.count(model=MODEL, input="And in one word?",
                                                    previous_response_id=response.id)
    continued = await sdk.responses.create(model=MODEL, input="And in one word?", previous_response_id=response.id,
                                           max_output_tokens=1)
    assert continued.usage is not None and follow.input_tokens == continued.usage.input_tokens
    alone = await sdk.responses.input_tokens.count(model=MODEL, instructions="Be brief.")
    assert 0 < alone.input_tokens < counted.input_tokens


async def test_input_tokens_count_what_would_not_fit(client: httpx.AsyncClient) -> None:
    """Counting is how a client learns whether a prompt fits: one longer than the context window
    (tiny-random's is 2048) is counted, where a response to it is refused."""
    long = "word " * 3000
    counted = await client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": long})
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 2048 and counted.json()["object"] == "response.input_tokens"
    refused = await client.post("/v1/responses", json={"model": MODEL, "input": long})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"


BAD_COUNTS: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("no model", {"input": "Hi"}, 400, "invalid_request", "model"),
    ("an unknown model", {"model": "no-such-model", "input": "Hi"}, 404, "model_not_found", "model"),
    ("no input nor instructions", {"model": MODEL}, 400, "invalid_request", "input"),
    ("a generation option", {"model": MODEL, "input": "Hi", "max_output_tokens": 5}, 400, "unsupported_parameter",
     "max_output_tokens"),
    ("an image", {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "unsupported_content_type", "input[0].content[0].type"),
    ("an unknown tool choice", {"model": MODEL, "input": "Hi", "tools": [TOOL],
                                "tool_choice": {"type": "function", "name": "other"}}, 400, "unknown_tool",
     "tool_choice"),
    ("an unknown previous response", {"model": MODEL, "input": "Hi",
                                      "previous_response_id": "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"}, 404,
     "response_not_found", "previous_response_id"),
    ("truncation auto", {"model": MODEL, "input": "Hi", "truncation": "auto"}, 400, "unsupported_value",
     "truncation"),
]


@pytest.mark.parametrize(("fields", "status", "code", "param"), [case[1:] for case in BAD_COUNTS],
                         ids=[case[0] for case in BAD_COUNTS])
async def test_bad_counts_get_openai_errors(client: httpx.AsyncClient, fields: dict[str, Any], status: int,
                                            code: str, param: str | None) -> None:
    answer = await client.post("/v1/responses/input_tokens", json=fields)
    assert answer.status_code == status, answer.text
    assert answer.json() == {"error": {"message": answer.json()["error"]["message"], "param": param, "code": code,
                                       "type": "invalid_request_error"}}


async def test_the_paths_beside_a_response_id_are_not_ids(client: httpx.AsyncClient) -> None:
    compact = await client.post("/v1/responses/compact", json={"input": "Hi"})  # the spec's 400: no model
    assert compact.status_code == 400 and compact.json()["error"]["param"] == "model"
    assert (await client.get("/v1/responses/input_tokens")).status_code in (404, 405)
    document = (await client.get("/schema/openapi.json")).json()
    assert {"/v1/responses/input_tokens", "/v1/responses/compact"} <= set(document["paths"])
