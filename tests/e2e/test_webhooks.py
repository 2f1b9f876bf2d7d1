"""Signed webhooks end to end: real API, worker and Redis processes send events to a receiver in the
test process, which checks them with the official ``openai`` package's verifier.

The tests run on a Redis of their own: every API process sends whatever deliveries are due, and the
session's APIs refuse the private address the receiver listens on. The module's API allows private
targets and retries after a second.
"""

import json
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio

from lmsp_core.store.tenants import credentials
from tests.support import (
    Api,
    Received,
    Receiver,
    RedisServer,
    TokenFactory,
    Worker,
    all_running,
    assert_problem,
    batch_lines,
    bearer,
    body,
    chat_line,
    run_batch,
    run_lmsp,
    service_env,
    until_final,
    wait_for,
)

VERIFIER = openai.OpenAI(api_key="unused").webhooks
HOOKS = {"webhook_allow_private": "true", "webhook_retry_delays": "1,1,1"}


@pytest.fixture(scope="module")
def hooks_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest_asyncio.fixture(scope="module")
async def hooks(hooks_redis: RedisServer, models_file: str) -> AsyncIterator[tuple[Api, Worker]]:
    """The module's API and worker, started side by side."""
    api = Api(hooks_redis.url, models_file=models_file, **HOOKS)
    worker = Worker(hooks_redis.url, ["tiny-random"], models_file=models_file)
    async with all_running(api, worker):
        yield api, worker


@pytest.fixture(scope="module")
def hooks_worker(hooks: tuple[Api, Worker]) -> Worker:
    return hooks[1]


@pytest.fixture(scope="module")
def hooks_api(hooks: tuple[Api, Worker]) -> Api:
    return hooks[0]


@pytest_asyncio.fixture
async def http(hooks_api: Api) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=hooks_api.url, timeout=60) as client:
        yield client


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


async def create(http: httpx.AsyncClient, url: str, events: list[str]) -> dict[str, Any]:
    created = await http.post("/lmsp/v1/webhooks", json={"url": url, "events": events})
    assert created.status_code == 201, created.text
    endpoint: dict[str, Any] = created.json()
    assert endpoint["secret"].startswith("whsec_") and created.headers["location"].endswith(endpoint["id"])
    return endpoint


def event_of(received: Received, secret: str) -> Any:
    """The event, verified as an application verifies OpenAI's webhooks."""
    return VERIFIER.unwrap(received.body, received.headers, secret=secret)


def of_type(received: list[Received], event_type: str) -> list[Received]:
    return [r for r in received if msgspec.json.decode(r.body)["type"] == event_type]


async def test_a_background_response_sends_signed_events(hooks_worker: Worker, http: httpx.AsyncClient,
                                                         hooks_api: Api, receiver: Receiver) -> None:
    # tiny-random's text runs to its budget: the response ends incomplete
    endpoint = await create(http, f"{receiver.url}/openai", ["response.incomplete", "task.incomplete"])
    sdk = openai.AsyncOpenAI(base_url=f"{hooks_api.url}/v1", api_key="unused", max_retries=0)
    try:
        response = await sdk.responses.create(model="tiny-random", input="Hello there", max_output_tokens=4,
                                              background=True, store=True)
        received = await receiver.wait(2)
        final = await sdk.responses.retrieve(response.id)
    finally:
        await sdk.close()
    assert final.status == "incomplete"
    [ended] = of_type(received, "response.incomplete")
    event = event_of(ended, endpoint["secret"])
    assert event.type == "response.incomplete" and event.data.id == response.id and event.object == "event"
    assert ended.headers["webhook-id"] == event.id and event.id.startswith("evt_")
    assert ended.headers["content-type"] == "application/json" and ended.path == "/openai"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        VERIFIER.unwrap(ended.body.replace(response.id.encode(), b"resp_forged"), ended.headers,
                        secret=endpoint["secret"])
    [task] = of_type(received, "task.incomplete")
    data = msgspec.json.decode(task.body)["data"]
    assert data["response_id"] == response.id and data["id"].startswith("task_")
    event_of(task, endpoint["secret"])  # every event is signed alike


async def test_tasks_send_their_end_and_direct_responses_nothing(hooks_worker: Worker, http: httpx.AsyncClient,
                                                                  receiver: Receiver) -> None:
    endpoint = await create(http, receiver.url, ["task.completed", "task.incomplete", "task.cancelled",
                                                 "response.incomplete"])
    direct = await http.post("/lmsp/v1/responses", json=body(max_output_tokens=2, store=True))
    assert direct.status_code == 200, direct.text
    queued = await http.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"))  # no worker: it waits
    assert (await http.post(f"/lmsp/v1/tasks/{queued.json()['id']}/cancel")).json()["status"] == "cancelled"
    task = await http.post("/lmsp/v1/tasks", json=body(max_output_tokens=2))
    assert task.status_code == 202
    received = await receiver.wait(2)
    events = sorted((event.type, event.data.id) for event in (event_of(r, endpoint["secret"]) for r in received))
    assert events == sorted([("task.cancelled", queued.json()["id"]), ("task.incomplete", task.json()["id"])])
    # the direct response (stored) sent nothing; neither did the task's response (not stored)
    assert len(receiver.received) == 2


async def test_a_batch_sends_its_end(hooks_worker: Worker, http: httpx.AsyncClient, hooks_api: Api,
                                     receiver: Receiver) -> None:
    endpoint = await create(http, receiver.url, ["batch.completed", "task.incomplete", "task.completed"])
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-random", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}
    sdk = openai.AsyncOpenAI(base_url=f"{hooks_api.url}/v1", api_key="unused", max_retries=0)
    try:
        uploaded = await sdk.files.create(file=("batch.jsonl", msgspec.json.encode(line) + b"\n"), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        [received] = await receiver.wait(1)
    finally:
        await sdk.close()
    event = event_of(received, endpoint["secret"])
    assert event.type == "batch.completed" and event.data.id == batch.id
    assert received.headers["webhook-id"] == f"evt_{batch.id}_completed"
    assert len(receiver.received) == 1  # its line's task, which ended before, sent nothing


async def test_a_batch_outlives_a_killed_worker_and_api_and_its_webhook_arrives(
        hooks_redis: RedisServer, models_file: str, hooks_api: Api, hooks_worker: Worker, receiver: Receiver) -> None:
    """Issue 43's fault proof on one Redis: the worker and the API that made the batch are killed
    mid-batch; every line ends once, and batch.completed reaches the receiver, each copy with the
    same webhook-id."""
    doomed_api = Api(hooks_redis.url, models_file=models_file, **HOOKS)
    doomed = Worker(hooks_redis.url, ["tiny-random"], models_file=models_file, lease_ttl=1.5)
    lines = [chat_line(f"k-{n}", "Tell me about the sea", tokens=40) for n in range(100)]
    async with all_running(doomed_api, doomed):
        async with httpx.AsyncClient(base_url=doomed_api.url, timeout=60) as client:
            endpoint = await create(client, receiver.url, ["batch.completed"])
        async with openai.AsyncOpenAI(base_url=f"{doomed_api.url}/v1", api_key="unused", max_retries=0) as sdk:
            _, batch = await run_batch(sdk, lines)
            await wait_for(lambda: _lines_done(sdk, batch.id, 5), what="some lines to end")
        doomed.kill()
        doomed_api.kill()
    async with openai.AsyncOpenAI(base_url=f"{hooks_api.url}/v1", api_key="unused", max_retries=0) as sdk:
        done = await until_final(sdk, batch.id)
        output, errors = await batch_lines(sdk, done.output_file_id), await batch_lines(sdk, done.error_file_id)
    assert done.status == "completed" and not errors
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
    await receiver.wait(1)
    ours = [r for r in receiver.received if json.loads(r.body)["data"]["id"] == batch.id]
    assert ours and {r.headers["webhook-id"] for r in ours} == {f"evt_{batch.id}_completed"}
    assert event_of(ours[0], endpoint["secret"]).type == "batch.completed"


async def _lines_done(sdk: openai.AsyncOpenAI, batch_id: str, count: int) -> bool:
    return (await sdk.batches.retrieve(batch_id)).request_counts.completed >= count


async def test_a_failed_attempt_is_retried_with_the_same_id(http: httpx.AsyncClient, receiver: Receiver) -> None:
    endpoint = await create(http, receiver.url, ["batch.completed"])
    receiver.answers = [500]
    sent = await http.post(f"/lmsp/v1/webhooks/{endpoint['id']}/test")
    assert sent.status_code == 202 and sent.json()["event_type"] == "webhook.test"
    first, second = await receiver.wait(2)
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == sent.json()["event_id"]
    assert first.body == second.body
    assert event_of(second, endpoint["secret"]).type == "webhook.test"

    async def delivered() -> dict[str, Any] | None:
        page = (await http.get(f"/lmsp/v1/webhooks/{endpoint['id']}/deliveries")).json()
        return page if page["data"][0]["status"] == "delivered" else None

    page = await wait_for(delivered, 10, "the delivery's success recorded")
    [delivery] = page["data"]
    assert delivery["id"] == sent.json()["id"] and not page["has_more"]
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 200]
    assert delivery["attempts"][0]["error"] == "the receiver answered 500" and delivery["attempts"][1]["error"] is None


async def test_endpoints_are_listed_without_secrets_and_deleted(http: httpx.AsyncClient, receiver: Receiver) -> None:
    endpoint = await create(http, receiver.url, ["batch.failed"])
    listing = await http.get("/lmsp/v1/webhooks")
    assert endpoint["id"] in [e["id"] for e in listing.json()["data"]] and endpoint["secret"] not in listing.text
    shown = await http.get(f"/lmsp/v1/webhooks/{endpoint['id']}")
    assert shown.json() == {k: v for k, v in endpoint.items() if k != "secret"}
    assert (await http.delete(f"/lmsp/v1/webhooks/{endpoint['id']}")).status_code == 204
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/deliveries"), ("POST", "/test")):
        assert_problem(await http.request(method, f"/lmsp/v1/webhooks/{endpoint['id']}{path}"), 404,
                       "webhook_not_found")


async def test_private_targets_and_bad_endpoints_are_refused(api: Api, receiver: Receiver) -> None:
    """The session's API does not allow private targets (the service's default)."""
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as client:
        await refusals(client, receiver)


async def refusals(client: httpx.AsyncClient, receiver: Receiver) -> None:
    for url in (receiver.url, "http://localhost:8080/x", "http://[::1]/x", "http://169.254.169.254/latest",
                "http://10.1.2.3/x", "https://[::ffff:192.168.0.1]/x"):
        refused = await client.post("/lmsp/v1/webhooks", json={"url": url, "events": ["task.completed"]})
        assert_problem(refused, 400, "webhook_url_not_allowed")
    for url in ("ftp://receiver.example/x", "not a url", "https://receiver.example/caf\u00e9"):
        refused = await client.post("/lmsp/v1/webhooks", json={"url": url, "events": ["task.completed"]})
        assert_problem(refused, 400, "invalid_webhook_url")
    refused = await client.post("/lmsp/v1/webhooks", json={"url": "https://receiver.invalid/x",
                                                           "events": ["task.completed"]})
    assert_problem(refused, 400, "webhook_url_unresolved")
    refused = await client.post("/lmsp/v1/webhooks", json={"url": "https://8.8.8.8/x", "events": ["task.done"]})
    assert_problem(refused, 400, "unknown_event_type")
    assert_problem(await client.post("/lmsp/v1/webhooks", json={"url": "https://8.8.8.8/x", "events": []}), 400,
                   "invalid_request")


async def test_webhooks_need_their_scope(secure_api: Api, make_token: TokenFactory) -> None:
    async with httpx.AsyncClient(base_url=secure_api.url, timeout=30) as secure:
        await scoped(secure, make_token)


async def scoped(secure: httpx.AsyncClient, make_token: TokenFactory) -> None:
    others, _ = await make_token([s for s in credentials.GRANTABLE if s != credentials.WEBHOOKS_MANAGE])
    for method, path in (("GET", "/lmsp/v1/webhooks"), ("POST", "/lmsp/v1/webhooks")):
        refused = await secure.request(method, path, headers=bearer(others),
                                       json={"url": "https://8.8.8.8/x", "events": ["task.completed"]})
        assert_problem(refused, 403, "insufficient_scope")
    manager, _ = await make_token([credentials.WEBHOOKS_MANAGE])
    listing = await secure.get("/lmsp/v1/webhooks", headers=bearer(manager))
    assert listing.status_code == 200 and listing.json()["data"] == []


async def test_a_waiting_retry_survives_its_api_process(models_file: str, receiver: Receiver) -> None:
    """An API process killed (SIGKILL) while a delivery waits for its retry: another one sends it."""
    redis = RedisServer()
    redis.start()
    settings = {**HOOKS, "webhook_retry_delays": "2"}
    first = Api(redis.url, models_file=models_file, **settings).start()
    second = Api(redis.url, models_file=models_file, **settings)
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=30) as http:
            endpoint = await create(http, receiver.url, ["task.completed"])
            receiver.answers = [503]
            sent = (await http.post(f"/lmsp/v1/webhooks/{endpoint['id']}/test")).json()

            async def retry_waits() -> bool:
                page = (await http.get(f"/lmsp/v1/webhooks/{endpoint['id']}/deliveries")).json()
                return bool(page["data"][0]["attempts"])

            await wait_for(retry_waits, 10, "the failed attempt recorded")
        first.signal(signal.SIGKILL)
        first.wait()
        second.start()
        _, retried = await receiver.wait(2, timeout=30)
        assert retried.headers["webhook-id"] == sent["event_id"]
        assert event_of(retried, endpoint["secret"]).type == "webhook.test"
        async with httpx.AsyncClient(base_url=second.url, timeout=30) as http:
            async def delivered() -> list[Any] | None:
                page = (await http.get(f"/lmsp/v1/webhooks/{endpoint['id']}/deliveries")).json()
                return page["data"][0]["attempts"] if page["data"][0]["status"] == "delivered" else None

            attempts = await wait_for(delivered, 10, "the retry recorded")
        assert [a["status_code"] for a in attempts] == [503, 200]
    finally:
        first.kill()
        second.stop()
        redis.cleanup()


def test_the_cli_manages_endpoints(hooks_redis: RedisServer, hooks_api: Api) -> None:
    env = service_env(hooks_redis.url)

    def lmsp(*args: str) -> subprocess.CompletedProcess[str]:
        return run_lmsp("webhook", *args, env=env)

    principal = f"cli-{uuid.uuid4().hex[:8]}"
    created = lmsp("create", "--principal", principal, "--url", "https://8.8.8.8/hook", "--events",
                   "batch.completed,task.failed")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert secret.startswith("whsec_") and "shown only now" in created.stderr
    webhook_id = created.stderr.split()[1]
    listed = lmsp("list", "--principal", principal)
    assert listed.stdout.startswith(f"{webhook_id}\t{principal}\thttps://8.8.8.8/hook\tbatch.completed,task.failed\t")
    assert secret not in listed.stdout
    assert lmsp("deliveries", webhook_id).stdout == ""
    refused = lmsp("create", "--principal", principal, "--url", "https://8.8.8.8/hook", "--events", "task.done")
    assert refused.returncode == 2 and "Unknown event type" in refused.stderr
    assert lmsp("delete", webhook_id).returncode == 0
    assert lmsp("delete", webhook_id).returncode == 1
