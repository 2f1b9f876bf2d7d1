"""A property-based fuzz run against the live API (hypothesis): whatever arrives, the answer is never
a 5xx, and every error is an application/problem+json document with a stable code.

Request bodies are drawn near the shape of a valid LMSP request (so that they reach deep checks)
and then broken in every way; routes, path parameters, query parameters and headers come from the
service's own OpenAPI schema. The run is bounded by example counts (well under a minute)."""

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmsp_core.store.tenants import credentials as store
from tests.support import PROBLEM, Api, RedisServer, Worker

FUZZ = settings(max_examples=150, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

visible = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
header_value = visible.map(str.strip)  # HTTP itself allows no surrounding whitespace
json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=12), inner, max_size=4), max_leaves=12)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the intended value, sometimes any JSON at all."""
    return st.one_of(strategy, strategy, strategy, json_value)


part = st.fixed_dictionaries({"type": maybe(st.sampled_from(["input_text", "output_text", "input_image", "x"])),
                              "text": maybe(st.text(max_size=60))})
message = st.fixed_dictionaries({
    "type": st.just("message"), "role": maybe(st.sampled_from(["system", "user", "assistant", "tool"])),
    "content": maybe(st.lists(maybe(part), max_size=3))})
function_call = st.fixed_dictionaries({"type": st.just("function_call"), "call_id": maybe(visible),
                                       "name": maybe(visible), "arguments": maybe(st.text(max_size=30))})
item = message | function_call | json_value
tool = st.fixed_dictionaries({"type": maybe(st.just("function")), "name": maybe(visible)},
                             optional={"parameters": json_value, "description": maybe(st.text(max_size=20))})
model = st.sampled_from(["tiny-random", "no-such-model", ""]) | st.text(max_size=20)

fields: dict[str, st.SearchStrategy[Any]] = {
    "stream": maybe(st.booleans()),
    "max_output_tokens": maybe(st.integers(-3, 6) | st.integers(1025, 2**40)),
    "temperature": maybe(st.floats(-1, 3, allow_nan=False)),
    "tools": maybe(st.lists(tool, max_size=3)),
    "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
    "response_format": maybe(st.sampled_from([{"type": "text"}, {"type": "json_schema"}, {"type": "xml"}])),
    "store": maybe(st.booleans()),
    "previous_response_id": maybe(visible),
    "extensions": json_value,
    "colour": json_value,
}
request_body = st.fixed_dictionaries({"model": maybe(model), "input": maybe(st.lists(item, min_size=0, max_size=3))},
                                     optional=fields)


def bounded(payload: Any) -> Any:
    """Keep generation cheap: a valid request for the served model generates a few tokens at most."""
    if isinstance(payload, dict) and payload.get("model") == "tiny-random":
        wanted = payload.get("max_output_tokens")
        if not isinstance(wanted, int) or isinstance(wanted, bool) or 6 < wanted <= 1024:
            payload = payload | {"max_output_tokens": 4}
    return payload


@pytest.fixture(scope="module")
def credentials(redis_server: RedisServer) -> dict[str, str]:
    async def create() -> dict[str, str]:
        redis = aioredis.Redis.from_url(redis_server.url)
        try:
            full, _ = await store.create(redis, "fuzz", list(store.GRANTABLE))
            narrow, _ = await store.create(redis, "fuzz", ["models:read"])
        finally:
            await redis.aclose()
        return {"full": full, "narrow": narrow}

    return asyncio.run(create())


@pytest.fixture(scope="module")
def http(secure_api: Api, tiny_worker: Worker) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=secure_api.url, timeout=60) as client:
        yield client


def authorization(credentials: dict[str, str]) -> st.SearchStrategy[dict[str, str]]:
    full = {"Authorization": f"Bearer {credentials['full']}"}
    return st.one_of(st.just(full), st.just(full), st.just(full),
                     st.just({"Authorization": f"Bearer {credentials['narrow']}"}), st.just({}),
                     header_value.map(lambda v: {"Authorization": v}))


extra_headers = st.dictionaries(st.sampled_from(["Idempotency-Key", "LMSP-Version", "Last-Event-ID", "Accept",
                                                 "Content-Type"]), header_value, max_size=2)


def check(response: httpx.Response) -> None:
    """The property: no 5xx; an error is a problem document whose status and type match (on the
    OpenAI routes: OpenAI's error object)."""
    assert response.status_code < 500, (response.status_code, response.read()[:500])
    if response.status_code >= 400 and response.request.url.path.startswith("/v1/"):
        assert response.headers["content-type"] == "application/json", response.headers
        if response.request.method != "HEAD":
            error = json.loads(response.read())["error"]
            assert set(error) == {"message", "type", "param", "code"} and re.fullmatch(r"[a-z0-9_]+", error["code"])
            assert error["message"] and "Traceback" not in error["message"]
        return
    if response.status_code >= 400:
        assert response.headers["content-type"] == PROBLEM, response.headers
        if response.request.method == "HEAD":
            return  # no body, by definition
        problem = json.loads(response.read())
        assert problem["status"] == response.status_code
        assert re.fullmatch(r"[a-z0-9_]+", problem["code"]) and problem["type"] == f"urn:lmsp:problem:{problem['code']}"
        assert problem["title"] and problem["detail"] and "Traceback" not in problem["detail"]


def send(http: httpx.Client, method: str, url: str, **kwargs: Any) -> None:
    # streams are only opened: closing them at once also exercises the cancel-on-disconnect path
    with http.stream(method, url, **kwargs) as response:
        check(response)


@pytest.mark.parametrize("endpoint", ["/lmsp/v1/responses", "/lmsp/v1/tasks"])
@FUZZ
@given(data=st.data())
def test_fuzz_generation_requests(http: httpx.Client, credentials: dict[str, str], endpoint: str,
                                  data: st.DataObject) -> None:
    payload = data.draw(st.one_of(request_body, request_body, request_body, json_value).map(bounded))
    headers = data.draw(authorization(credentials)) | data.draw(extra_headers)
    if data.draw(st.booleans()):
        send(http, "POST", endpoint, content=json.dumps(payload).encode(),
             headers={"Content-Type": "application/json", **headers})
    else:
        raw = data.draw(st.binary(max_size=200))
        send(http, "POST", endpoint, content=raw, headers={"Content-Type": "application/json", **headers})


@FUZZ
@given(data=st.data())
def test_fuzz_every_route_of_the_schema(http: httpx.Client, credentials: dict[str, str],
                                        data: st.DataObject) -> None:
    schema = _schema(http)
    operations = sorted((path, method) for path, item in schema["paths"].items() for method in item)
    path, method = data.draw(st.sampled_from(operations))
    task_id = _task(http, credentials)
    url = re.sub(r"\{[^}]+\}", lambda _: data.draw(st.sampled_from([task_id, "tiny-random"]) | visible.filter(
        lambda v: v not in ("", ".", "..") and "/" not in v and "?" not in v and "#" not in v)), path)
    params = data.draw(st.dictionaries(st.sampled_from(["after", "x"]), visible, max_size=1))
    headers = data.draw(authorization(credentials)) | data.draw(extra_headers)
    body = json.dumps(bounded(data.draw(request_body))).encode() if method == "post" else None
    send(http, method.upper(), url, params=params, headers=headers, content=body)


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"), max_size=40))
def test_fuzz_unknown_routes_and_methods(http: httpx.Client, method: str, path: str) -> None:
    send(http, method, "/lmsp/v1/" + path)


_cache: dict[str, Any] = {}


def _schema(http: httpx.Client) -> dict[str, Any]:
    if "schema" not in _cache:
        _cache["schema"] = http.get("/schema/openapi.json").json()
    schema: dict[str, Any] = _cache["schema"]
    return schema


def _task(http: httpx.Client, credentials: dict[str, str]) -> str:
    """A real task of the fuzz principal, so that routes with a task id get past the look-up."""
    if "task" not in _cache:
        response = http.post("/lmsp/v1/tasks", json={"model": "tiny-random", "max_output_tokens": 4, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
            headers={"Authorization": f"Bearer {credentials['full']}"})
        _cache["task"] = response.json()["id"]
    task_id: str = _cache["task"]
    return task_id
