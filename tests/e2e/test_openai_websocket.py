"""OpenAI's WebSocket mode of ``/v1/responses`` over real sockets (the ``websockets`` package and the
official ``openai`` package's ``responses.connect``) against a real API and tiny-random worker:
several responses on one socket, their events the very JSON of the SSE stream, a ``store: false``
response continued with only its new input, ``previous_response_not_found`` after a reconnect, error
envelopes for bad messages, the handshake's credentials, and a dropped socket losing nothing stored.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from tests.support import SECURE_CORS_ORIGIN, Api, TokenFactory, Worker, collect
from tests.support.tokens import bearer

MODEL = "tiny-random"
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
FINAL = {"response.completed", "response.incomplete", "response.failed"}


def ws_url(api: Api) -> str:
    return api.url.replace("http://", "ws://", 1) + "/v1/responses"


@asynccontextmanager
async def socket(api: Api, token: str | None = None) -> AsyncIterator[ClientConnection]:
    async with connect(ws_url(api), additional_headers=bearer(token) if token else {}, open_timeout=30) as ws:
        yield ws


async def receive(ws: ClientConnection) -> dict[str, Any]:
    message = await asyncio.wait_for(ws.recv(), 60)
    assert isinstance(message, str)  # text messages, as OpenAI sends them
    decoded: dict[str, Any] = json.loads(message)
    return decoded


async def create(ws: ClientConnection, **fields: Any) -> list[dict[str, Any]]:
    """Send a ``response.create`` and receive its events up to the final one (or its error envelope)."""
    await ws.send(json.dumps({"type": "response.create", "model": MODEL, **fields}))
    events = [await receive(ws)]
    while events[-1]["type"] not in FINAL | {"error"}:
        events.append(await receive(ws))
    return events


def completed(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The response the events end with (cut short at ``max_output_tokens`` or not), each event checked."""
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)  # each as the openai package's own model reads it
    response: dict[str, Any] = events[-1]["response"]
    return response


def text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


async def test_responses_one_after_another_are_the_sse_events(api: Api, tiny_worker: Worker,
                                                               client: httpx.AsyncClient) -> None:
    async with socket(api) as ws:
        # the second create is sent before the first response ends: it is answered after it, in order
        await ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "Hello there",
                                  "max_output_tokens": 8}))
        first = completed(await create(ws, input="And again", max_output_tokens=8, stream=True, store=True))
        events = [await receive(ws)]
        while events[-1]["type"] not in FINAL:
            events.append(await receive(ws))
        second = completed(events)
    assert first["id"] != second["id"] and first["store"] and second["status"] in ("completed", "incomplete")
    # the same JSON the SSE stream of the stored response carries, event for event
    replayed = await collect(client, "GET", f"/v1/responses/{second['id']}?stream=true")
    assert [event.data for event in replayed] == events
    assert [event.event for event in replayed] == [event["type"] for event in events]


async def test_a_store_false_response_continues_on_its_socket(api: Api, tiny_worker: Worker,
                                                              client: httpx.AsyncClient) -> None:
    async with socket(api) as ws:
        first = completed(await create(ws, input="My name is Ada.", store=False, max_output_tokens=6))
        events = await create(ws, input=[{"role": "user", "content": "What is my name?"}], store=False,
                              previous_response_id=first["id"], max_output_tokens=6, stream_id="lane-1")
        second = completed(events)
    assert second["previous_response_id"] == first["id"] and not second["store"]
    assert {event["stream_id"] for event in events} == {"lane-1"}
    # the model read the whole conversation: the first turn, its answer, then the new input
    whole = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": text(first)},
             {"role": "user", "content": "What is my name?"}]
    counted = await client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": whole})
    assert second["usage"]["input_tokens"] == counted.json()["input_tokens"]
    # not stored: nothing beside the socket knows it, and a new socket cannot continue it
    assert (await client.get(f"/v1/responses/{first['id']}")).status_code == 404
    async with socket(api) as ws:
        refused = await create(ws, input="Go on.", store=False, previous_response_id=first["id"])
        again = completed(await create(ws, input="Hi", max_output_tokens=2))
    assert refused == [{"type": "error", "status": 400, "error": {
        "type": "invalid_request_error", "code": "previous_response_not_found", "param": "previous_response_id",
        "message": refused[0]["error"]["message"]}}]
    assert again["output"]


BAD_MESSAGES = [
    ("not JSON", "{response.create", "invalid_request", None),
    ("not an object", "[1, 2]", "invalid_request", None),
    ("another type", json.dumps({"type": "session.update"}), "unsupported_value", "type"),
    ("no model", json.dumps({"type": "response.create", "input": "Hi"}), "invalid_request", "model"),
    ("an unknown field", json.dumps({"type": "response.create", "model": MODEL, "input": "Hi", "colour": 1}),
     "unsupported_parameter", "colour"),
    ("an unknown model", json.dumps({"type": "response.create", "model": "no-such", "input": "Hi"}),
     "model_not_found", "model"),
    ("background", json.dumps({"type": "response.create", "model": MODEL, "input": "Hi", "background": True}),
     "unsupported_value", "background"),
    ("a warm-up", json.dumps({"type": "response.create", "model": MODEL, "input": "Hi", "generate": False}),
     "unsupported_value", "generate"),
]


async def test_bad_messages_get_error_envelopes(api: Api, tiny_worker: Worker) -> None:
    async with socket(api) as ws:
        for name, message, code, param in BAD_MESSAGES:
            await ws.send(message)
            error = await receive(ws)
            assert error["type"] == "error" and error["error"]["code"] == code, (name, error)
            assert error["error"]["param"] == param and error["status"] in (400, 404), (name, error)
        await ws.send(b'{"type": "response.create", "model": "tiny-random", "input": "Hi", "stream_id": "b"}')
        events = [await receive(ws)]
        while events[-1]["type"] not in FINAL:
            events.append(await receive(ws))
        assert completed(events)["output"]  # the socket goes on, binary messages too


async def test_the_handshake_carries_the_credentials(secure_api: Api, tiny_worker: Worker,
                                                     make_token: TokenFactory) -> None:
    for token, status, code in [(None, 401, "unauthorized"), ("not-a-token", 401, "invalid_token")]:
        with pytest.raises(InvalidStatus) as refused:
            async with socket(secure_api, token):
                pass
        assert refused.value.response.status_code == status
        assert refused.value.response.body is not None
        assert json.loads(refused.value.response.body)["error"]["code"] == code
    reader, _ = await make_token(["responses:read"])
    with pytest.raises(InvalidStatus) as denied:
        async with socket(secure_api, reader):
            pass
    assert denied.value.response.status_code == 403
    writer, _ = await make_token(["responses:write"])
    # a browser's page opens sockets without CORS's preflight: only the origins CORS allows may
    with pytest.raises(InvalidStatus) as elsewhere:
        async with connect(ws_url(secure_api), additional_headers=bearer(writer), origin="https://evil.example"):
            pass
    assert elsewhere.value.response.status_code == 403
    assert elsewhere.value.response.body is not None
    assert json.loads(elsewhere.value.response.body)["error"]["code"] == "origin_not_allowed"
    async with connect(ws_url(secure_api), additional_headers=bearer(writer), origin=SECURE_CORS_ORIGIN) as ws:
        assert completed(await create(ws, input="Hi", max_output_tokens=2))["output"]


async def test_a_dropped_socket_loses_nothing_stored(api: Api, tiny_worker: Worker,
                                                     client: httpx.AsyncClient) -> None:
    async with socket(api) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "A long story.",
                                  "max_output_tokens": 300}))
        created = await receive(ws)
        while (await receive(ws))["type"] != "response.output_text.delta":
            pass
    response_id = created["response"]["id"]
    resumed = await collect(client, "GET", f"/v1/responses/{response_id}?stream=true")
    assert resumed[0].data == created and resumed[-1].event in ("response.completed", "response.incomplete")
    final = (await client.get(f"/v1/responses/{response_id}")).json()
    assert final["status"] in ("completed", "incomplete") and final["usage"]["output_tokens"] > 0


async def test_a_dropped_socket_cancels_what_was_not_stored(secure_api: Api, tiny_worker: Worker,
                                                               make_token: TokenFactory) -> None:
    token, _ = await make_token()
    for _ in range(3):  # more than the principal's two streams: each drop gives its slot back
        async with socket(secure_api, token) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "A long story.",
                                      "store": False, "max_output_tokens": 1000}))
            while (await receive(ws))["type"] != "response.output_text.delta":
                pass
    async with socket(secure_api, token) as ws:
        assert completed(await create(ws, input="Hi", max_output_tokens=2))["output"]


async def test_the_openai_client_connects(api: Api, tiny_worker: Worker) -> None:
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)
    try:
        async with client.responses.connect() as connection:
            await connection.response.create(model=MODEL, input="Hello", store=False, max_output_tokens=4)
            first = [event async for event in _until_final(connection)]
            done = first[-1]
            assert done.type in ("response.completed", "response.incomplete") and done.response.output
            await connection.response.create(model=MODEL, input="More", store=False, max_output_tokens=4,
                                             previous_response_id=done.response.id)
            second = [event async for event in _until_final(connection)]
            assert second[-1].type in ("response.completed", "response.incomplete")
            assert second[-1].response.previous_response_id == done.response.id
            await connection.response.create(model=MODEL, input="Hi", previous_response_id="resp_missing")
            error = await connection.recv()
            assert error.type == "error" and error.error.code == "previous_response_not_found"
    finally:
        await client.close()


async def _until_final(connection: Any) -> AsyncIterator[Any]:
    while True:
        event = await asyncio.wait_for(connection.recv(), 60)
        yield event
        if event.type in FINAL:
            return
