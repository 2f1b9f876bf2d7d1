"""The OpenAPI document tells the whole truth: a bounded schemathesis run (every check) against a
live API and a worker, as `st run <base>/schema/openapi.json --checks all` does at length.

Its worker serves the model the document's examples name with the tiny random model's weights, so
that the examples generate (in milliseconds) instead of answering 503 model_unavailable.
"""

import json
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
from litestar.exceptions import LitestarDeprecationWarning
from litestar.serialization import encode_json
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup

from api.http.app import create_app
from api.http.openapi import document as doc
from lmsp_core.settings import Settings
from tests.support import Api, RedisServer, Worker, tiny_spec

# Refusals that no JSON Schema of the request can say, because they depend on something other than
# the request (stored state, the model, DNS) or on relations JSON Schema has no words for; each is a
# 4xx with its own stable code (docs/protocol.md), and schemathesis' "schema-valid request rejected"
# is not a failure for them. Everything else the server refuses, the document says (enums, patterns,
# bounds, if/then rules), and the fuzzer holds it to that:
SEMANTIC_REFUSALS = {
    # an Idempotency-Key used before with another body: the state of an earlier request (the fuzzer
    # repeats keys across bodies)
    "idempotency_key_reused",
    # what the model the request names allows (GET /lmsp/v1/models tells it, not the request's
    # schema): its output and context limits, the tokens its shortest complete tool call or JSON
    # object takes, its capabilities, text-only input (the content types that LMSP 1.0 reserves,
    # input_image, input_audio, input_file, are a model's to take)
    "max_output_tokens_too_large", "context_length_exceeded", "max_output_tokens_too_small",
    "unsupported_capability", "unsupported_content_type",
    # relations between values of a request: a tool_choice among the tools' names, unique tool names
    # (uniqueItems compares whole tools), a function call's output after that call
    "unknown_tool", "invalid_tool_choice", "duplicate_tool_name", "unmatched_call_id",
    # a schema inside the request that the grammar engine cannot compile
    "invalid_tool_schema", "invalid_json_schema",
    # the state of the conversation that previous_response_id continues
    "conversation_too_long", "previous_response_in_progress",
    # a webhook URL whose host does not resolve (the document's example is one: a reserved name,
    # RFC 2606, that sends nobody's events anywhere), or resolves to an address the service does not
    # send to: DNS says it, not the URL, whose form the document gives as a pattern; and a principal's
    # endpoints beyond their number (state)
    "webhook_url_unresolved", "webhook_url_not_allowed", "too_many_webhooks",
    # what an uploaded file holds: JSONL is not a regular language, so no pattern of the file's bytes
    # says it (contentMediaType is an annotation, not a check), nor does one count its lines
    "invalid_file_format", "too_many_lines",
}
SEED = 20261130  # the same cases every run
MAX_EXAMPLES = 12  # per operation in the fuzzing phase; the examples and coverage phases add their own


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as client:
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def fuzzed_api() -> Iterator[Api]:
    """Its own Redis (the fuzzer creates many tasks), a worker and an API with the service's defaults."""
    models = [tiny_spec(doc.MODEL, max_output_tokens=64,
                        capabilities=["streaming", "tools", "structured_output", "conversations"])]
    with tempfile.TemporaryDirectory(prefix="lmsp-fuzz-") as directory:
        models_file = Path(directory) / "models.json"
        models_file.write_text(json.dumps(models))
        redis = RedisServer()
        redis.start()
        worker = Worker(redis.url, [doc.MODEL], models_file=str(models_file))
        api = Api(redis.url, models_file=str(models_file), rate_limit=None, max_streams=None)
        try:
            worker.start()
            api.start()
            wait_ready(api.url)
            yield api
        finally:
            api.stop()
            worker.stop()
            redis.cleanup()


def document() -> dict[str, Any]:
    """The OpenAPI document as the API serves it (built in process: the cases are generated at
    collection, before any server runs; test_the_served_document_is_this_one checks they agree)."""
    with warnings.catch_warnings():
        # Litestar's own deprecation notices about inferred dependencies (as in test_auth.py)
        warnings.simplefilter("ignore", LitestarDeprecationWarning)
        built = create_app(Settings()).openapi_schema.to_schema()
    served: dict[str, Any] = json.loads(encode_json(built))  # as the API writes it
    return served


CONFIG = SchemathesisConfig.from_dict({
    "seed": SEED,
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "database": "none"},
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True}},
})
DOCUMENT = document()
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


def test_the_served_document_is_this_one(fuzzed_api: Api) -> None:
    served = httpx.get(f"{fuzzed_api.url}/schema/openapi.json", timeout=30).json()
    assert served == document()


def _code(body: Any) -> str | None:
    """The stable code of a problem document or of an OpenAI error object."""
    if not isinstance(body, dict):
        return None
    code = body.get("code") if "code" in body else (body.get("error") or {}).get("code")
    return code if isinstance(code, str) else None


def refusal_code(response: Any) -> str | None:
    """The code of a 4xx answer, None for any other."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        return _code(response.json())
    except ValueError:
        return None


def documented_codes(method: str, path: str, status: int) -> set[str] | None:
    """The codes of the examples the document gives for this status of this operation (None for a
    method the path does not have: schemathesis checks that its answer is 405)."""
    operation = DOCUMENT["paths"][path].get(method.lower())
    if operation is None:
        return None
    answer = operation["responses"].get(str(status), {})
    return {_code(example.get("value")) or "" for content in answer.get("content", {}).values()
            for example in content.get("examples", {}).values()}


@schema.parametrize()
def test_the_document_tells_the_truth(case: Any, fuzzed_api: Api) -> None:
    response = case.call(base_url=fuzzed_api.url, timeout=60)
    code = refusal_code(response)
    try:
        case.validate_response(response)
    except FailureGroup as group:
        failures = [failure for failure in group.exceptions
                    if not (failure.code == "ST202" and code in SEMANTIC_REFUSALS)]
        if failures:
            raise FailureGroup(failures, str(group)) from None
    # each refusal is one the operation documents, by its code (schemathesis checks the status only)
    documented = documented_codes(case.method, case.path, response.status_code)
    assert code is None or documented is None or code in documented, (
        f"{case.method} {case.path} answered {response.status_code} {code}, which it does not document")


def test_task_events_match_their_schema(fuzzed_api: Api) -> None:
    """The fuzzer meets a task's events only with ids it invents; these are a real task's, every
    event checked against the documented event schema (and a resumed stream's too)."""
    created = httpx.post(f"{fuzzed_api.url}/lmsp/v1/tasks", json=msgspec.to_builtins(doc.REQUEST), timeout=30)
    assert created.status_code == 202
    events = schema["/lmsp/v1/tasks/{task_id}/events"]["GET"]
    for query in ({}, {"after": "2"}):
        case = events.Case(path_parameters={"task_id": created.json()["id"]}, query=query)
        response = case.call(base_url=fuzzed_api.url, timeout=60)
        assert response.status_code == 200 and response.text.count("\nevent: response.") >= 2
        case.validate_response(response)


def test_every_guarded_operation_documents_its_refusals() -> None:
    """A route with a scope may answer 401, 403 and 429 (the rate limit, and for a stream the open
    streams' limit): its operation says so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LitestarDeprecationWarning)
        app = create_app(Settings())
    paths = document()["paths"]
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            if handler.opt.get("public") or not handler.include_in_schema or handler.http_methods == {"OPTIONS"}:
                continue
            for method in handler.http_methods:
                operation = paths[route.path_format][method.lower()]
                assert {"401", "403", "429"} <= set(operation["responses"]), (method, route.path)
                if "text/event-stream" in operation["responses"].get("200", {}).get("content", {}):
                    examples = operation["responses"]["429"]["content"]
                    assert "too_many_streams" in json.dumps(examples), (method, route.path)


def test_bodies_are_decoded_as_strictly_as_documented(fuzzed_api: Api) -> None:
    url = f"{fuzzed_api.url}/lmsp/v1/tasks"
    request = msgspec.to_builtins(doc.REQUEST)
    for field, value in [("max_output_tokens", "4"), ("store", 0), ("temperature", "0.5")]:
        refused = httpx.post(url, json=request | {field: value}, timeout=30)
        assert refused.status_code == 400 and refused.json()["code"] == "invalid_request", (field, refused.text)
        assert refused.json()["errors"][0]["key"] == field
    # JSON Schema's integer includes 4.0
    assert httpx.post(url, json=request | {"max_output_tokens": 4.0}, timeout=30).status_code == 202
    chat = {"model": doc.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"}
    refused = httpx.post(f"{fuzzed_api.url}/v1/chat/completions", json=chat, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens", refused.text


def test_parameters_are_refused_as_documented(fuzzed_api: Api) -> None:
    task = httpx.post(f"{fuzzed_api.url}/lmsp/v1/tasks", json=msgspec.to_builtins(doc.REQUEST), timeout=30).json()
    events = f"{fuzzed_api.url}/lmsp/v1/tasks/{task['id']}/events"
    # a malformed Last-Event-ID is refused even where ?after wins
    refused = httpx.get(events, params={"after": "1"}, headers={"Last-Event-ID": "x"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_cursor"
    tasks = f"{fuzzed_api.url}/lmsp/v1/tasks"
    for cursor in ["1" * 16 + "." + task["id"], "1794200000000." + task["id"] + "x"]:
        refused = httpx.get(tasks, params={"cursor": cursor}, timeout=30)
        assert refused.status_code == 400 and refused.json()["code"] == "invalid_cursor", cursor
    assert httpx.get(tasks, params={"cursor": ""}, timeout=30).status_code == 200  # empty: the first page
    for key in ["", "a b", "k" * 256, "\xe9".encode("latin-1")]:
        refused = httpx.post(tasks, json=msgspec.to_builtins(doc.REQUEST), headers={"Idempotency-Key": key},
                             timeout=30)
        assert refused.status_code == 400 and refused.json()["code"] == "invalid_idempotency_key", key
