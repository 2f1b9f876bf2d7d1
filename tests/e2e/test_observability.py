"""Prometheus metrics, probes, the status view and the OpenAPI schema of the running service."""

import asyncio
import time
from contextlib import aclosing
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate
from prometheus_client.parser import text_string_to_metric_families

from lmsp_core import wire
from tests.support import Api, TokenFactory, Worker, bearer, body, sse_events, wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_a_task_shows_in_the_metrics(client: httpx.AsyncClient) -> None:
    before = await scrape(client)
    task = (await client.post("/lmsp/v1/tasks", json=body(max_output_tokens=25))).json()
    async for _ in sse_events(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events"):
        pass
    model = {"model": "tiny-random"}
    deadline = time.monotonic() + 60
    while True:  # workers add theirs with each heartbeat
        after = await scrape(client)
        if value(after, "lmsp_generated_tokens_total", **model) >= value(before, "lmsp_generated_tokens_total",
                                                                        **model) + 25:
            break
        assert time.monotonic() < deadline, "the worker's counts never arrived"
        await asyncio.sleep(0.2)

    def grew(name: str, by: float, **labels: str) -> bool:
        return value(after, name, **labels) >= value(before, name, **labels) + by

    assert grew("lmsp_tasks_created_total", 1, kind="task", **model)
    assert grew("lmsp_tasks_finished_total", 1, status="incomplete", **model)
    assert grew("lmsp_queue_time_seconds_count", 1, **model)
    assert grew("lmsp_time_to_first_token_seconds_count", 1, **model)
    assert grew("lmsp_inter_token_latency_seconds_count", 24, **model)
    assert value(after, "lmsp_inter_token_latency_seconds_bucket", le="+Inf", **model) == value(
        after, "lmsp_inter_token_latency_seconds_count", **model)
    assert value(after, "lmsp_workers_alive") >= 1 and value(after, "lmsp_model_workers", **model) >= 1
    assert value(after, "lmsp_model_workers", model="tiny-unserved") == 0


async def test_queue_depth_open_streams_and_status(client: httpx.AsyncClient) -> None:
    base = await scrape(client)
    unserved = {"model": "tiny-unserved"}
    tasks = [(await client.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"))).json()["id"] for _ in range(2)]
    queued = await scrape(client)
    assert value(queued, "lmsp_queue_depth", **unserved) == value(base, "lmsp_queue_depth", **unserved) + 2
    assert value(queued, "lmsp_tasks", status="queued", **unserved) == value(queued, "lmsp_queue_depth", **unserved)
    status = (await client.get("/status")).json()
    model = next(m for m in status["models"] if m["id"] == "tiny-unserved")
    assert model["queued"] == value(queued, "lmsp_queue_depth", **unserved) and model["workers"] == 0
    assert any("tiny-random" in worker["models"] for worker in status["workers"])

    async with client.stream("GET", f"/lmsp/v1/tasks/{tasks[0]}/events") as stream, \
            aclosing(stream.aiter_lines()) as lines:  # closed when left, not when collected
        assert (await anext(lines)).startswith(": queued ")  # the queue position, as a comment
        streaming = await scrape(client)
        assert value(streaming, "lmsp_open_streams", kind="task") == value(base, "lmsp_open_streams", kind="task") + 1
    for task_id in tasks:
        await client.post(f"/lmsp/v1/tasks/{task_id}/cancel")
    done = await scrape(client)
    # cancelled tasks leave the queue at once, even with no worker to pop them
    assert value(done, "lmsp_queue_depth", **unserved) == value(base, "lmsp_queue_depth", **unserved)
    assert value(done, "lmsp_tasks_finished_total", status="cancelled", **unserved) == value(
        base, "lmsp_tasks_finished_total", status="cancelled", **unserved) + 2
    deadline = time.monotonic() + 30
    while value(await scrape(client), "lmsp_open_streams", kind="task") != value(base, "lmsp_open_streams",
                                                                                  kind="task"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_each_principal_shows_in_the_status_and_metrics(tenant_api: Api, tiny_worker: Worker,
                                                              make_token: TokenFactory) -> None:
    tokens = dict([await make_token(), await make_token()])
    alice, bob = tokens.values()
    clients = {name: httpx.AsyncClient(base_url=tenant_api.url, timeout=60, headers=bearer(token))
               for token, name in tokens.items()}

    async def create(principal: str, **fields: Any) -> str:
        response = await clients[principal].post("/lmsp/v1/tasks", json=body(**fields))
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    waiting: list[str] = []
    try:
        waiting += [await create(alice, model="tiny-unserved") for _ in range(2)]
        done = {alice: [await create(alice, max_output_tokens=n) for n in (7, 11)],
                bob: [await create(bob, max_output_tokens=9)]}
        samples = await scrape(clients[alice])
        unserved = {"model": "tiny-unserved", "principal": alice}
        assert value(samples, "lmsp_principal_tasks", status="queued", **unserved) == 2
        assert ("lmsp_principal_tasks", tuple(sorted({**unserved, "status": "running"}.items()))) in samples
        rows = (await clients[alice].get("/status")).json()["principals"]
        assert {"model": "tiny-unserved", "principal": alice, "queued": 2, "running": 0, "generated_tokens": 0,
                "weight": 1.0, "max_running": None, "max_queued": None} in rows
        assert rows == sorted(rows, key=lambda row: (row["model"], -row["queued"] - row["running"], row["principal"]))

        used = dict.fromkeys(done, 0)  # each principal's output tokens, once its tasks are final
        for name, task_ids in done.items():
            for task_id in task_ids:
                async def final(name: str = name, task_id: str = task_id) -> dict[str, Any] | None:
                    task: dict[str, Any] = (await clients[name].get(f"/lmsp/v1/tasks/{task_id}")).json()
                    return task if task["status"] in wire.FINAL_STATUSES else None

                used[name] += (await wait_for(final, what="a final task"))["response"]["usage"]["output_tokens"]
        assert all(used.values())

        async def counted() -> Samples | None:  # workers add theirs with each heartbeat
            after = await scrape(clients[bob])
            return after if all(value(after, "lmsp_principal_generated_tokens_total", model="tiny-random",
                                      principal=name) == n for name, n in used.items()) else None

        samples = await wait_for(counted, what="the principals' tokens")
        rows = (await clients[bob].get("/status")).json()["principals"]
        for name, n in used.items():
            labels = {"model": "tiny-random", "principal": name}
            assert {**labels, "queued": 0, "running": 0, "generated_tokens": n, "weight": 1.0, "max_running": None,
                    "max_queued": None} in rows
            for status in ("queued", "running"):
                assert ("lmsp_principal_tasks", tuple(sorted({**labels, "status": status}.items()))) in samples
    finally:
        for task_id in waiting:
            await clients[alice].post(f"/lmsp/v1/tasks/{task_id}/cancel")
        for client in clients.values():
            await client.aclose()


async def test_probes(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["models"]["tiny-random"] >= 1 and ready.json()["models"]["tiny-unserved"] == 0


@pytest.fixture
async def schema(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/schema/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


async def test_openapi_schema_is_valid_and_documents_every_route(schema: dict[str, Any]) -> None:
    validate(schema)
    operations = [(path, method, op) for path, item in schema["paths"].items() for method, op in item.items()]
    assert {path for path, _, _ in operations} >= {
        "/lmsp/v1/responses", "/lmsp/v1/tasks", "/lmsp/v1/tasks/{task_id}", "/lmsp/v1/tasks/{task_id}/events",
        "/lmsp/v1/tasks/{task_id}/cancel", "/lmsp/v1/models", "/lmsp/v1/models/{model_id}", "/healthz", "/readyz",
        "/metrics", "/status"}
    for path, method, op in operations:
        where = f"{method.upper()} {path}"
        assert op.get("summary") and op.get("description"), where
        if "requestBody" in op:  # Litestar puts body examples into the schema (JSON Schema `examples`)
            # but a form's file part has none: an example value is sent as a plain field, not a file
            assert all(media["schema"].get("examples") for kind, media in op["requestBody"]["content"].items()
                       if kind != "multipart/form-data"), where
        for status, response in op["responses"].items():
            for media_type, media in (response.get("content") or {}).items():
                assert media.get("examples"), f"{where} {status} {media_type}"
                if status.startswith(("4", "5")) and path not in ("/readyz",):
                    # the OpenAI routes answer OpenAI's error object (tests/e2e/test_openai_access.py)
                    expected = "application/json" if path.startswith("/v1/") else "application/problem+json"
                    assert media_type == expected, f"{where} {status}"
        assert any(status.startswith("2") for status in op["responses"]), where


async def test_schema_examples_match_what_the_service_sends(schema: dict[str, Any],
                                                            client: httpx.AsyncClient) -> None:
    body_schema = schema["paths"]["/lmsp/v1/tasks"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    request = body_schema["examples"][0]
    request["model"] = "tiny-random"
    created = await client.post("/lmsp/v1/tasks", json=request)
    assert created.status_code == 202
    documented = schema["paths"]["/lmsp/v1/tasks"]["post"]["responses"]["202"]["content"]["application/json"]
    assert set(next(iter(documented["examples"].values()))["value"]) == set(created.json())
