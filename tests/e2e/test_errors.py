"""Bad input and unavailable dependencies get RFC 9457 problem documents, never a traceback."""

from typing import Any

import httpx
import pytest

from tests.support import Api, RedisServer, assert_problem, body


def image_part() -> dict[str, Any]:
    return {"type": "input_image", "image_url": "https://example.com/cat.png"}


BAD_BODIES: list[tuple[str, dict[str, Any] | str, int, str]] = [
    ("unknown top-level field", body(colour="blue"), 400, "invalid_request"),
    ("missing model", {"input": body()["input"]}, 400, "invalid_request"),
    ("empty input", body() | {"input": []}, 400, "invalid_request"),
    ("unknown item type", body() | {"input": [{"type": "banana"}]}, 400, "invalid_request"),
    ("bad role", body() | {"input": [{"type": "message", "role": "robot", "content": []}]}, 400, "invalid_request"),
    ("temperature out of range", body(temperature=3.5), 400, "invalid_request"),
    ("max_output_tokens zero", body(max_output_tokens=0), 400, "invalid_request"),
    ("stream not a boolean", body(stream="yes"), 400, "invalid_request"),
    ("malformed JSON", "{not json", 400, "invalid_request"),
    ("unknown model", body(model="no-such-model"), 404, "model_not_found"),
    ("image content", body() | {"input": [{"type": "message", "role": "user", "content": [image_part()]}]},
     400, "unsupported_content_type"),
    # tiny-unserved has only the streaming capability
    ("tools without the capability",
     body(model="tiny-unserved", tools=[{"type": "function", "name": "f", "parameters": {}}]),
     400, "unsupported_capability"),
    ("json_schema without the capability",
     body(model="tiny-unserved",
          response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
     400, "unsupported_capability"),
    ("previous_response_id without the capability", body(model="tiny-unserved", previous_response_id="resp_x"), 400,
     "unsupported_capability"),
    ("max_output_tokens above the model's cap", body(max_output_tokens=5000), 400, "max_output_tokens_too_large"),
    ("prompt plus output beyond the context window", body(text="word " * 1500, max_output_tokens=1000), 400,
     "context_length_exceeded"),
    ("prompt alone beyond the context window", body(text="word " * 2100), 400, "context_length_exceeded"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("case", "payload", "status", "code"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
async def test_bad_requests_get_problem_documents(client: httpx.AsyncClient, case: str, payload: Any, status: int,
                                                  code: str, stream: bool) -> None:
    if isinstance(payload, dict):
        payload = payload | {"stream": stream} if "stream" not in payload else payload
        response = await client.post("/lmsp/v1/responses", json=payload)
    else:
        response = await client.post("/lmsp/v1/responses", content=payload,
                                     headers={"content-type": "application/json"})
    problem = assert_problem(response, status, code)
    assert problem["detail"]


async def test_unknown_fields_are_named(client: httpx.AsyncClient) -> None:
    problem = assert_problem(await client.post("/lmsp/v1/responses", json=body(colour="blue")), 400,
                             "invalid_request")
    assert "colour" in problem["detail"]


async def test_lmsp_version(client: httpx.AsyncClient) -> None:
    ok = await client.post("/lmsp/v1/responses", json=body(max_output_tokens=1), headers={"LMSP-Version": "1.0"})
    assert ok.status_code == 200
    assert_problem(await client.post("/lmsp/v1/responses", json=body(), headers={"LMSP-Version": "2.0"}), 400,
                   "unsupported_version")
    assert_problem(await client.get("/lmsp/v1/models", headers={"LMSP-Version": "0.9"}), 400, "unsupported_version")


async def test_unknown_route_and_wrong_method(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/lmsp/v1/nothing-here"), 404, "not_found")
    assert_problem(await client.delete("/lmsp/v1/responses"), 405, "method_not_allowed")
    assert_problem(await client.get("/lmsp/v1/responses"), 405, "method_not_allowed")


async def test_oversized_body(client: httpx.AsyncClient) -> None:
    response = await client.post("/lmsp/v1/responses", json=body(text="x" * (5 * 1024 * 1024)))
    assert_problem(response, 413, "request_too_large")


async def test_models_without_a_live_worker(client: httpx.AsyncClient) -> None:
    models = {m["id"]: m for m in (await client.get("/lmsp/v1/models")).json()["data"]}
    assert models["tiny-unserved"]["status"] == "unavailable" and models["tiny-unserved"]["workers"] == 0
    response = await client.post("/lmsp/v1/responses", json=body(model="tiny-unserved"))
    problem = assert_problem(response, 503, "model_unavailable")
    assert response.headers["retry-after"]
    assert "task" in problem["detail"]
    # a task waits in the queue instead
    assert (await client.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"))).status_code == 202


async def test_redis_down_gives_503_and_recovers() -> None:
    server = RedisServer()
    server.start()
    api = Api(server.url).start()
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
            assert (await http.get("/lmsp/v1/models")).status_code == 200
            server.stop()
            response = await http.post("/lmsp/v1/tasks", json=body())
            assert_problem(response, 503, "service_unavailable")
            assert response.headers["retry-after"]
            assert_problem(await http.get("/lmsp/v1/models"), 503, "service_unavailable")
            server.start()
            assert (await http.get("/lmsp/v1/models")).status_code == 200
    finally:
        api.stop()
        server.cleanup()
    assert "Traceback" not in api.output()
