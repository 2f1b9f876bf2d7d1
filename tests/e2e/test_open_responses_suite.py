"""The Open Responses compliance suite's test cases, run here as our own tests (the suite itself cannot:
it lives only on GitHub, which neither this machine nor CI reaches, and its code is not ours to vendor;
docs/protocol.md, "Open Responses").

They follow github.com/openresponses/openresponses ``src/lib/compliance-tests.ts`` at commit
18e565604fdf7a08ad3a06bbc30d1ddaee999ea4 (with ``tool-calling-streaming`` of 0cb939ccf839234347b4f0c3
17569b49fad8fd0e): each case makes the suite's very request, with the suite's ``Authorization: Bearer``
header, to the default model (SmolLM2: the suite asks for answers that end by themselves, ``completed``),
and checks what the suite checks: a 2xx, the response object (the body, or the final event's
``response``) and every SSE event valid against Open Responses' schemas (``tests.support.openresponses``),
then the case's own checks. Each case runs over HTTP and again over WebSocket mode (one
``response.create`` per request, on one socket), whose events must pass the same checks.

The suite sends its cases all at once; here they run one after another. SmolLM2's greedy answer to a
prompt depends on which others share its batch (the 4-bit products are not batch-invariant), and in
some batches the pirate prompt's answer repeats itself to the output limit: the test would be
flaky, and would test the model rather than the service.

- ``basic-response`` Basic Text Response: output, status ``completed``.
- ``streaming-response`` Streaming Response (``stream: true``): events, every one valid, ``completed``.
- ``system-prompt`` System Prompt: a system message first; output, ``completed``.
- ``tool-calling`` Tool Calling: ``get_weather`` with ``tool_choice`` left ``auto``; a ``function_call``
  in the output. **Excepted**: SmolLM2 answers in text. The response must still be valid.
- ``tool-calling-streaming`` Tool Calling (Streaming): the same, streamed, with the function call's
  ``output_item.added``, ``function_call_arguments.delta``/``.done`` and ``output_item.done`` events.
  **Excepted** as ``tool-calling``; with the tool forced (``tool_choice`` naming it) every event is there.
- ``function-call-roundtrip`` Function Call Round Trip: a forced ``get_weather`` call, then its
  ``function_call_output`` with ``previous_response_id``; the second response has output, ``completed``.
- ``image-input`` Image Input (an ``input_image`` data URL). **Excepted**: the models are text-only, so
  400 ``unsupported_content_type`` (docs/protocol.md), which the test asserts.
- ``file-input`` File Input (an ``input_file`` PDF). **Excepted** the same way.
- ``multi-turn`` Multi-turn Conversation: user, assistant, user messages; output, ``completed``.
- ``previous-response-id`` Previous Response ID: a second response continuing the first by id.
- ``file-search``, ``offline-web-search``: optional, skipped by the suite unless a vector store or
  offline web search is configured; this service has neither tool: 400 ``unsupported_value``.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from websockets.asyncio.client import ClientConnection, connect

from tests.support import Api, Worker, collect, event_problems, resource_problems

pytestmark = pytest.mark.smollm2

MODEL = "smollm2:135m-instruct"
AUTH = {"Authorization": "Bearer sk-test-123"}  # what the suite sends: the open test API ignores it
FINAL = {"response.completed", "response.incomplete", "response.failed"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a location",
           "parameters": {"type": "object", "properties": {"location": {
               "type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
               "required": ["location"]}}
FORCED = {"type": "function", "name": "get_weather"}


def message(role: str, content: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


# the suite's requests (``model`` added as it adds it)
BASIC = {"input": [message("user", "Say hello in exactly 3 words.")]}
STREAMING = {"input": [message("user", "Count from 1 to 5.")]}
SYSTEM = {"input": [message("system", "You are a pirate. Always respond in pirate speak."),
                    message("user", "Say hello.")]}
WEATHER_QUESTION = {"input": [message("user", "What's the weather like in San Francisco?")], "tools": [WEATHER]}
ROUNDTRIP = {"input": "Use the weather tool to get the temperature in San Francisco.", "tools": [WEATHER],
             "tool_choice": FORCED}
MULTI_TURN = {"input": [message("user", "My name is Alice."),
                        message("assistant", "Hello Alice! Nice to meet you. How can I help you today?"),
                        message("user", "What is my name?")]}
REMEMBER = {"input": "Remember this code word: papaya. Reply with only OK."}
RECALL = {"input": "What code word did I ask you to remember?"}
IMAGE = {"input": [message("user", [
    {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
    {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1Pe"
                                         "AAAADElEQVR42mP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"}])]}
FILE = {"input": [message("user", [
    {"type": "input_text", "text": "Read the attached file and answer with its title only."},
    {"type": "input_file", "filename": "openresponses-fixture.pdf",
     "file_data": "data:application/pdf;base64,JVBERi0xLjEKJSVFT0Y="}])]}
FILE_SEARCH = {"input": "Search the configured vector store for relevant content and summarize one result.",
               "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}],
               "tool_choice": {"type": "file_search"}, "include": ["file_search_call.results"]}
WEB_SEARCH = {"input": "Find the most relevant cached result for OpenResponses.",
              "tools": [{"type": "web_search", "external_web_access": False}],
              "tool_choice": {"type": "web_search"}, "include": ["web_search_call.action.sources"]}


@pytest_asyncio.fixture(scope="module")
async def smol(api: Api, smollm2_worker: Worker) -> AsyncIterator[Api]:
    """The session's API, with its SmolLM2 worker (uncompiled: conftest) ready."""
    yield api


class Transport:
    """The suite's two ways in: ``POST /v1/responses`` (SSE where streamed), or WebSocket mode."""

    def __init__(self, api: Api, http: httpx.AsyncClient, kind: str) -> None:
        self.api, self.http, self.kind = api, http, kind
        self.socket: ClientConnection | None = None  # opened by the first WebSocket request, then kept
        self.events: list[dict[str, Any]] = []  # the last request's events (streamed or WebSocket)

    async def create(self, body: dict[str, Any], stream: bool = False) -> dict[str, Any]:
        """The response to ``body``, checked as the suite checks it: its object and every event valid."""
        request = {"model": MODEL, **body, "stream": stream}
        if self.kind == "websocket":
            self.events = await self.over_socket(request)
        elif stream:
            self.events = [event.data for event in
                           await collect(self.http, "POST", "/v1/responses", json=request, headers=AUTH)]
        else:
            answer = await self.http.post("/v1/responses", json=request, headers=AUTH)
            assert answer.is_success, answer.text
            self.events = []
            response: dict[str, Any] = answer.json()
            assert resource_problems(response) == [], response
            return response
        assert self.events, "no streaming events received"
        assert [problem for event in self.events for problem in event_problems(event)] == []
        assert self.events[-1]["type"] in FINAL, self.events[-1]
        final: dict[str, Any] = self.events[-1]["response"]
        return final

    async def refused(self, body: dict[str, Any]) -> dict[str, Any]:
        """The error a request gets: OpenAI's error object over HTTP, the error envelope over a socket."""
        request = {"model": MODEL, **body}
        if self.kind == "websocket":
            events = await self.over_socket(request)
            assert len(events) == 1 and events[0]["type"] == "error", events
            assert events[0]["status"] == 400
            error: dict[str, Any] = events[0]["error"]
            return error
        answer = await self.http.post("/v1/responses", json=request, headers=AUTH)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        return error

    async def over_socket(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """The events a ``response.create`` gets, up to its final event or its error envelope."""
        url = self.api.url.replace("http://", "ws://", 1) + "/v1/responses"
        if self.socket is None:
            self.socket = await connect(url, additional_headers=AUTH, open_timeout=30)
        await self.socket.send(json.dumps({"type": "response.create", **request}))
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] not in FINAL | {"error"}:
            message = await asyncio.wait_for(self.socket.recv(), 300)
            events.append(json.loads(message))
        return events

    async def close(self) -> None:
        if self.socket is not None:
            await self.socket.close()


@pytest_asyncio.fixture(params=["http", "websocket"])
async def suite(request: pytest.FixtureRequest, smol: Api) -> AsyncIterator[Transport]:
    async with httpx.AsyncClient(base_url=smol.url, timeout=300) as http:
        transport = Transport(smol, http, request.param)
        try:
            yield transport
        finally:
            await transport.close()


def completed_with_output(response: dict[str, Any]) -> None:
    """The suite's ``hasOutput`` and ``completedStatus``."""
    assert response["output"], "Response has no output items"
    assert response["status"] == "completed", response


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


@pytest.mark.parametrize("body", [BASIC, SYSTEM, MULTI_TURN], ids=["basic-response", "system-prompt", "multi-turn"])
async def test_single_requests(suite: Transport, body: dict[str, Any]) -> None:
    completed_with_output(await suite.create(body))


async def test_streaming_response(suite: Transport) -> None:
    response = await suite.create(STREAMING, stream=True)
    assert response["status"] == "completed"
    assert "response.output_text.delta" in types(suite.events)


async def test_previous_response_id(suite: Transport) -> None:
    first = await suite.create(REMEMBER)
    second = await suite.create(RECALL | {"previous_response_id": first["id"]})
    completed_with_output(second)
    assert second["previous_response_id"] == first["id"]


async def test_function_call_roundtrip(suite: Transport) -> None:
    first = await suite.create(ROUNDTRIP)
    call = next(item for item in first["output"] if item["type"] == "function_call")
    assert call["name"] == "get_weather" and "location" in json.loads(call["arguments"])
    second = await suite.create({"previous_response_id": first["id"], "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "64 degrees and clear"}]})
    completed_with_output(second)


async def test_tool_calling(suite: Transport) -> None:
    """Excepted where the model answers in text (``auto``): the response is valid all the same; the
    suite's check, a ``function_call`` item, holds once the call is forced."""
    completed_with_output(await suite.create(WEATHER_QUESTION))
    forced = await suite.create(WEATHER_QUESTION | {"tool_choice": FORCED})
    assert "function_call" in [item["type"] for item in forced["output"]]


async def test_tool_calling_streaming(suite: Transport) -> None:
    completed_with_output(await suite.create(WEATHER_QUESTION, stream=True))  # excepted as tool-calling
    await suite.create(WEATHER_QUESTION | {"tool_choice": FORCED}, stream=True)
    added = [e for e in suite.events if e["type"] == "response.output_item.added"]
    done = [e for e in suite.events if e["type"] == "response.output_item.done"]
    assert "function_call" in [e["item"]["type"] for e in added] and "function_call" in [
        e["item"]["type"] for e in done]
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(
        types(suite.events))


@pytest.mark.parametrize(("body", "param"), [(IMAGE, "input[0].content[1].type"),
                                             (FILE, "input[0].content[1].type")], ids=["image-input", "file-input"])
async def test_excepted_inputs_are_refused_as_documented(suite: Transport, body: dict[str, Any], param: str) -> None:
    error = await suite.refused(body)
    assert error["code"] == "unsupported_content_type" and error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [FILE_SEARCH, WEB_SEARCH], ids=["file-search", "offline-web-search"])
async def test_optional_tools_are_refused(suite: Transport, body: dict[str, Any]) -> None:
    error = await suite.refused(body)
    assert error["type"] == "invalid_request_error", error
    assert error["code"] == "unsupported_value" and error["param"] in ("tools[0].type", "include", "include[0]")


async def test_websocket_mode_continues_on_its_socket_only(smol: Api) -> None:
    """The WebSocket tests' conversation: ``store: false`` responses continued on the same socket with
    ``previous_response_id`` and only the new input, and ``previous_response_not_found`` (an error
    envelope, the socket going on) once the socket is gone."""
    async with httpx.AsyncClient(base_url=smol.url, timeout=300) as http:
        first_socket = Transport(smol, http, "websocket")
        try:
            first = await first_socket.create(REMEMBER | {"store": False})
            second = await first_socket.create(RECALL | {"store": False, "previous_response_id": first["id"]})
        finally:
            await first_socket.close()
        completed_with_output(second)
        assert second["previous_response_id"] == first["id"] and not second["store"]
        reconnected = Transport(smol, http, "websocket")
        try:
            events = await reconnected.over_socket({"model": MODEL, **RECALL, "previous_response_id": first["id"]})
            assert [event["type"] for event in events] == ["error"]
            assert events[0]["error"]["code"] == "previous_response_not_found"
            completed_with_output(await reconnected.create(BASIC))
        finally:
            await reconnected.close()
