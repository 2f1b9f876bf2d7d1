"""The /v1 routes under the same access rules as the LMSP routes: bearer tokens (the SDK's
``api_key``), scopes, stream limits, ``Idempotency-Key`` and CORS; and their OpenAPI description."""

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from openapi_spec_validator import validate

from api.http.app import OPENAI_SDK_HEADERS
from lmsp_core.store.tenants import credentials
from tests.support import OPENAI_ROUTES, SECURE_CORS_ORIGIN, Api, TokenFactory, Worker, bearer

MODEL = "tiny-random"
Client = Callable[[str], Awaitable[openai.AsyncOpenAI]]


@pytest_asyncio.fixture
async def sdk_for(secure_api: Api, tiny_worker: Worker) -> AsyncIterator[Client]:
    """SDK clients of the API with bearer tokens, one per key asked for."""
    clients: list[openai.AsyncOpenAI] = []

    async def make(api_key: str) -> openai.AsyncOpenAI:
        clients.append(openai.AsyncOpenAI(base_url=f"{secure_api.url}/v1", api_key=api_key, max_retries=0,
                                          timeout=120))
        return clients[-1]

    try:
        yield make
    finally:
        for client in clients:
            await client.close()


async def test_tokens_and_scopes(sdk_for: Client, make_token: TokenFactory, secure: httpx.AsyncClient) -> None:
    with pytest.raises(openai.AuthenticationError) as bad:
        await (await sdk_for("lmsp_not-a-token")).models.list()
    assert bad.value.code == "invalid_token" and bad.value.body["type"] == "authentication_error"
    assert "bearer" in bad.value.response.headers["www-authenticate"].lower()
    reader, _ = await make_token(["models:read"])
    assert MODEL in [model.id async for model in (await sdk_for(reader)).models.list()]
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await (await sdk_for(reader)).responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert denied.value.code == "insufficient_scope"
    writer, owner = await make_token(["responses:write", "responses:read"])
    sdk = await sdk_for(writer)
    assert (await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)).status == "incomplete"
    with pytest.raises(openai.PermissionDeniedError):  # a background response is a task
        await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, background=True)
    tasker, tasker_owner = await make_token(["responses:write", "responses:read", "tasks:read", "tasks:write"])
    background = await (await sdk_for(tasker)).responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                                                 background=True)
    # another principal's response does not exist for this one
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(background.id)
    listed = await secure.get("/lmsp/v1/tasks", headers={"Authorization": f"Bearer {tasker}"})
    assert background.id in {task["response_id"] for task in listed.json()["data"]}
    assert owner != tasker_owner


@pytest.mark.parametrize(("method", "path", "scope"), OPENAI_ROUTES, ids=[f"{r[0]} {r[1]}" for r in OPENAI_ROUTES])
async def test_each_route_needs_its_scope(secure: httpx.AsyncClient, make_token: TokenFactory, method: str,
                                          path: str, scope: str) -> None:
    url = path.format(response_id="resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF", model=MODEL,
                      file_id="file_01J8M6Q4W2T7N5R3V9X1Z8B0DF", batch_id="batch_01J8M6Q4W2T7N5R3V9X1Z8B0DF",
                      conversation_id="conv_01J8M6Q4W2T7N5R3V9X1Z8B0DF", item_id="msg_01J8M6Q4W2T7N5R3V9X1Z8B0DF")
    body = {"model": MODEL, "max_output_tokens": 1, "max_tokens": 1}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"input": "Hi"}
    kwargs: dict[str, Any] = _FORMS.get(path) or (_BODIES.get(path) if method == "POST" else None) or (
        {"json": {k: v for k, v in body.items() if k in _FIELDS[path]}} if method == "POST" else {})
    missing = await secure.request(method, url, **kwargs)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized"
    others, _ = await make_token([s for s in credentials.GRANTABLE if s != scope])
    denied = await secure.request(method, url, headers=bearer(others), **kwargs)
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    assert f'scope="{scope}"' in denied.headers["www-authenticate"]
    only, _ = await make_token([scope])
    allowed = await secure.request(method, url, headers=bearer(only), **kwargs)
    assert allowed.status_code in (200, 404), allowed.text  # past authorisation (the response is unknown)


_FIELDS = {"/v1/responses": {"model", "input", "max_output_tokens"},
           "/v1/responses/input_tokens": {"model", "input"}, "/v1/responses/compact": {"model", "input"},
           "/v1/chat/completions": {"model", "messages", "max_tokens"},
           "/v1/responses/{response_id}/cancel": set(), "/v1/batches/{batch_id}/cancel": set()}
# the routes whose JSON body is not a generation request
_BODIES: dict[str, dict[str, Any]] = {"/v1/batches": {"json": {
    "input_file_id": "file_01J8M6Q4W2T7N5R3V9X1Z8B0DF", "endpoint": "/v1/chat/completions",
    "completion_window": "24h"}}, "/v1/conversations": {"json": {}},
    "/v1/conversations/{conversation_id}": {"json": {"metadata": {}}},
    "/v1/conversations/{conversation_id}/items": {"json": {"items": [{"role": "user", "content": "Hi"}]}}}
# the routes whose body is a form (multipart)
_FORMS: dict[str, dict[str, Any]] = {"/v1/files": {"files": {"file": ("a.jsonl", b"{}\n")},
                                                   "data": {"purpose": "batch"}}}


async def test_the_stream_limit(sdk_for: Client, make_token: TokenFactory) -> None:
    token, _ = await make_token()
    sdk = await sdk_for(token)
    streams = [await sdk.responses.create(model=MODEL, input="A long story.", max_output_tokens=1000, stream=True,
                                          background=True) for _ in range(2)]  # secure_api allows two
    try:
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
        assert limited.value.code == "too_many_streams" and "retry-after" in limited.value.response.headers
    finally:
        ids = []
        for stream in streams:
            ids.append((await stream.__anext__()).response.id)
            await stream.close()
        for response_id in ids:
            await sdk.responses.cancel(response_id)


async def test_idempotency_keys(sdk_for: Client, make_token: TokenFactory) -> None:
    token, _ = await make_token()
    sdk = await sdk_for(token)
    key = {"Idempotency-Key": "openai-key-1"}
    first = await sdk.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=3,
                                                         extra_headers=key)
    repeat = await sdk.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=3,
                                                          extra_headers=key)
    assert repeat.parse().id == first.parse().id
    assert repeat.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    with pytest.raises(openai.UnprocessableEntityError) as reused:
        await sdk.responses.create(model=MODEL, input="Bye", max_output_tokens=3, extra_headers=key)
    assert reused.value.code == "idempotency_key_reused"
    with pytest.raises(openai.UnprocessableEntityError):  # the same key on another route
        await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          extra_headers=key)
    with pytest.raises(openai.UnprocessableEntityError):  # ... or for a background response
        await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=3, background=True, extra_headers=key)


async def test_cors_lets_the_sdk_call_from_a_page(secure: httpx.AsyncClient) -> None:
    preflight = await secure.options("/v1/responses", headers={
        "Origin": SECURE_CORS_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": ", ".join(["authorization", "content-type", *OPENAI_SDK_HEADERS]).lower()})
    assert preflight.status_code in (200, 204)
    assert preflight.headers["access-control-allow-origin"] == SECURE_CORS_ORIGIN
    assert "access-control-allow-credentials" not in preflight.headers


async def test_the_openapi_document_describes_the_v1_routes(client: httpx.AsyncClient) -> None:
    schema: dict[str, Any] = (await client.get("/schema/openapi.json")).json()
    validate(schema)
    paths = schema["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
            "/v1/chat/completions", "/v1/models", "/v1/models/{model}"} <= set(paths)
    for path, method in [("/v1/responses", "post"), ("/v1/responses/{response_id}", "get"),
                         ("/v1/chat/completions", "post")]:
        answer = paths[path][method]["responses"]["200"]["content"]
        assert set(answer) == {"application/json", "text/event-stream"}, path
    for path, item in paths.items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in item.items():
            statuses = {status for status in operation["responses"] if status[0] in "45"}
            assert {"400", "401", "403", "429", "503"} <= statuses, (method, path)
            for status in statuses:
                media = operation["responses"][status]["content"]
                assert set(media) == {"application/json"}, (method, path, status)
                for example in media["application/json"]["examples"].values():
                    assert set(example["value"]["error"]) == {"message", "type", "param", "code"}
