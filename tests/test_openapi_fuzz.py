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
import pytest
import schemathesis
from litestar.exceptions import LitestarDeprecationWarning
from litestar.serialization import encode_json
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup

from api import openapi as doc
from api.app import create_app
from lmsp_core.settings import Settings
from tests.support import Api, RedisServer, Worker, tiny_spec

# Refusals that follow from the request's meaning, which no JSON Schema of one request can say:
SEMANTIC_REFUSALS = {
    # an Idempotency-Key used before with another body (the fuzzer repeats keys across bodies)
    "idempotency_key_reused",
    # limits of the model the request names (in GET /lmsp/v1/models, not in the request's schema)
    "max_output_tokens_too_large", "context_length_exceeded",
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
    "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True}},
})
schema = schemathesis.openapi.from_dict(document(), config=CONFIG)


def test_the_served_document_is_this_one(fuzzed_api: Api) -> None:
    served = httpx.get(f"{fuzzed_api.url}/schema/openapi.json", timeout=30).json()
    assert served == document()


def semantic_refusal(response: Any) -> bool:
    """A 4xx whose stable code (a problem document's, or an OpenAI error object's) is one above."""
    if not 400 <= response.status_code < 500:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    code = body.get("code") if "code" in body else (body.get("error") or {}).get("code")
    return code in SEMANTIC_REFUSALS


@schema.parametrize()
def test_the_document_tells_the_truth(case: Any, fuzzed_api: Api) -> None:
    response = case.call(base_url=fuzzed_api.url, timeout=60)
    try:
        case.validate_response(response)
    except FailureGroup as group:
        failures = [failure for failure in group.exceptions
                    if not (failure.code == "ST202" and semantic_refusal(response))]
        if failures:
            raise FailureGroup(failures, str(group)) from None
