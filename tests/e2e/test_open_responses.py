"""What Open Responses and OpenAI clients need of ``/v1/responses`` beyond generating: every field of the
response object that Open Responses' ``ResponseResource`` requires, in bodies and lifecycle events
(docs/protocol.md, "OpenAI compatibility")."""

from typing import Any

import httpx
import openai
import pytest

from tests.support import RESPONSE_RESOURCE, collect

MODEL = "tiny-random"


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
    assert response["top_logprobs"] == 0
    retrieved = await client.get(f"/v1/responses/{response['id']}")
    assert assert_resource(retrieved.json())["status"] == response["status"]
    queued = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                                       "background": True})
    assert assert_resource(queued.json())["status"] == "queued"
    cancelled = await client.post(f"/v1/responses/{queued.json()['id']}/cancel")
    assert_resource(cancelled.json())


async def test_every_lifecycle_event_has_a_whole_response(client: httpx.AsyncClient) -> None:
    events = await collect(client, "POST", "/v1/responses", json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True, "top_logprobs": 2,
        "include": ["message.output_text.logprobs"], "presence_penalty": 0, "frequency_penalty": 0.0})
    lifecycle = [event for event in events if "response" in event.data]
    assert [event.event for event in lifecycle] == ["response.created", "response.in_progress",
                                                    "response.incomplete"]
    for event in lifecycle:
        assert assert_resource(event.data["response"])["top_logprobs"] == 2  # echoed from the request
    # a background response's stream, read again by id, carries the same fields
    queued = (await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                        "background": True})).json()
    replayed = await collect(client, "GET", f"/v1/responses/{queued['id']}", params={"stream": "true"})
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
