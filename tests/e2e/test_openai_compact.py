"""``POST /v1/responses/compact`` against a real API and tiny-random worker, with the official ``openai``
package (``responses.compact``) and httpx: a stored conversation and new input compacted by the model
into the conversation's user messages and one ``compaction`` item, which the next response takes as
its input; the spec's validation errors as OpenAI's error objects."""

from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import CompactedResponse, Response

from api.openai.compactionitem import SUMMARY_HEADING

MODEL = "tiny-random"


async def test_a_stored_conversation_compacts_into_the_next_input(sdk: openai.AsyncOpenAI,
                                                                  client: httpx.AsyncClient) -> None:
    first = await sdk.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8)
    raw = await sdk.responses.with_raw_response.compact(model=MODEL, previous_response_id=first.id,
                                                        input=[{"role": "user", "content": "Remember it."}])
    compacted: CompactedResponse = raw.parse()
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    assert compacted.output[-1].type == "compaction"
    # (the package types the kept user messages as its output messages, which are the assistant's: read them raw)
    items: list[dict[str, Any]] = raw.http_response.json()["output"]
    assert [(item["type"], item.get("role")) for item in items] == [("message", "user")] * 2 + [("compaction", None)]
    assert [item["content"][0]["text"] for item in items[:2]] == ["My name is Ada.", "Remember it."]
    summary = items[-1]
    assert summary["id"].startswith("cmp_") and isinstance(summary["encrypted_content"], str)
    # the summary was generated over the whole conversation: both turns and the new input
    assert compacted.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # type: ignore[union-attr]
    assert compacted.usage.total_tokens == compacted.usage.input_tokens + compacted.usage.output_tokens
    # the list is the next request's input, the summary an assistant turn that says what it is
    following = Response.model_validate((await sdk.responses.create(
        model=MODEL, input=[*items, {"role": "user", "content": "What is my name?"}],
        max_output_tokens=4)).to_dict())
    listed = (await client.get(f"/v1/responses/{following.id}/input_items", params={"order": "asc"})).json()
    assert [item["role"] for item in listed["data"]] == ["user", "user", "assistant", "user"]
    assert listed["data"][2]["content"][0]["text"] == SUMMARY_HEADING + summary["encrypted_content"]


async def test_input_alone_compacts(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/responses/compact", json={
        "model": MODEL, "instructions": "Be brief.", "input": [
            {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, how can I help?"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Plan a trip."}]}]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) >= {"id", "object", "output", "created_at", "usage"}  # Open Responses' CompactResource
    assert [item["type"] for item in body["output"]] == ["message", "message", "compaction"]
    assert [item["content"][0]["text"] for item in body["output"][:2]] == ["Hello", "Plan a trip."]


BAD = [
    ("no model", {"input": "Hi"}, 400, "invalid_request", "model"),
    ("no conversation", {"model": MODEL}, 400, "invalid_request", "input"),
    ("an unknown field", {"model": MODEL, "input": "Hi", "stream": True}, 400, "unsupported_parameter", "stream"),
    ("an unknown model", {"model": "no-such", "input": "Hi"}, 404, "model_not_found", "model"),
    ("an unknown response", {"model": MODEL, "previous_response_id": "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"}, 404,
     "response_not_found", "previous_response_id"),
    ("an image", {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, 400, "unsupported_content_type",
     "input[0].content[0].type"),
    ("an empty summary", {"model": MODEL, "input": [{"type": "compaction"}]}, 400, "invalid_request",
     "input[0].encrypted_content"),
]


@pytest.mark.parametrize(("fields", "status", "code", "param"), [case[1:] for case in BAD], ids=[c[0] for c in BAD])
async def test_bad_requests_get_openai_errors(client: httpx.AsyncClient, fields: dict[str, Any], status: int,
                                              code: str, param: str) -> None:
    answer = await client.post("/v1/responses/compact", json=fields)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
