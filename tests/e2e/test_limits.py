"""Limits, each with a problem document and a stable code: sizes, rate, queue depth, open streams."""

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from lmsp_core.settings import TOKENS_MAX_STREAMS, TOKENS_RATE_LIMIT, Settings
from lmsp_core.store.tasks import queue
from tests.support import Api, RedisServer, TokenFactory, Worker, assert_problem, bearer, body, tasks_of, user_input


@pytest.mark.parametrize("endpoint", ["/lmsp/v1/responses", "/lmsp/v1/tasks"])
async def test_size_limits_have_their_own_codes(client: httpx.AsyncClient, endpoint: str) -> None:
    items = user_input("hi") * 1025
    assert_problem(await client.post(endpoint, json=body() | {"input": items}), 400, "too_many_input_items")
    parts = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}] * 1025}]
    assert_problem(await client.post(endpoint, json=body() | {"input": parts}), 400, "too_many_input_items")
    tools = [{"type": "function", "name": f"f{i}"} for i in range(129)]
    assert_problem(await client.post(endpoint, json=body(tools=tools)), 400, "too_many_tools")
    long_text = body(text="x" * 600_000) | {"input": user_input("x" * 600_000) * 2}
    problem = assert_problem(await client.post(endpoint, json=long_text), 400, "input_too_long")
    assert "1200000" in problem["detail"]


async def test_queue_depth_per_model(client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    # tiny-queue has no worker and a queue of two (its model spec overrides LMSP_MAX_QUEUE_DEPTH)
    created = []
    while await queue.depth(redis, "tiny-queue") < 2:
        response = await client.post("/lmsp/v1/tasks", json=body(model="tiny-queue"))
        assert response.status_code == 202
        created.append(response.json()["id"])
    busy = await client.post("/lmsp/v1/tasks", json=body(model="tiny-queue"))
    assert_problem(busy, 503, "server_busy")
    assert int(busy.headers["retry-after"]) > 0
    # other models are not affected
    assert (await client.post("/lmsp/v1/responses", json=body(max_output_tokens=1))).status_code == 200


async def test_rate_per_principal(limited_api: Api, tiny_worker: Worker, make_token: TokenFactory) -> None:
    busy, _ = await make_token()
    calm, _ = await make_token()
    async with httpx.AsyncClient(base_url=limited_api.url, timeout=30) as http:
        for _ in range(5):
            assert (await http.get("/lmsp/v1/models", headers=bearer(busy))).status_code == 200
        refused = await http.get("/lmsp/v1/models", headers=bearer(busy))
        assert_problem(refused, 429, "rate_limited")
        assert 0 < int(refused.headers["retry-after"]) <= 60
        # every route counts, and the limit is per principal
        assert_problem(await http.post("/lmsp/v1/tasks", json=body(), headers=bearer(busy)), 429, "rate_limited")
        assert (await http.get("/lmsp/v1/models", headers=bearer(calm))).status_code == 200


async def test_body_size_is_a_setting(limited_api: Api, make_token: TokenFactory) -> None:
    token, _ = await make_token()
    async with httpx.AsyncClient(base_url=limited_api.url, timeout=30) as http:
        response = await http.post("/lmsp/v1/tasks", json=body(text="x" * 5000), headers=bearer(token))
        assert_problem(response, 413, "request_too_large")


async def _open_events(stack: AsyncExitStack, http: httpx.AsyncClient, task_id: str, token: str) -> httpx.Response:
    response = await stack.enter_async_context(
        http.stream("GET", f"/lmsp/v1/tasks/{task_id}/events", headers=bearer(token)))
    return response


async def _queued_task(http: httpx.AsyncClient, token: str) -> str:
    response = await http.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"), headers=bearer(token))
    assert response.status_code == 202
    task_id: str = response.json()["id"]
    return task_id


async def _eventually_opens(http: httpx.AsyncClient, task_id: str, token: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        async with http.stream("GET", f"/lmsp/v1/tasks/{task_id}/events", headers=bearer(token)) as response:
            if response.status_code == 200:
                return
        assert time.monotonic() < deadline, "the stream slot was never given back"
        await asyncio.sleep(0.2)


async def test_open_streams_per_principal(secure: httpx.AsyncClient, make_token: TokenFactory,
                                          redis: aioredis.Redis) -> None:
    token, principal = await make_token()
    other, _ = await make_token()
    task_id = await _queued_task(secure, token)
    async with AsyncExitStack() as stack:
        for _ in range(2):  # secure_api allows two
            assert (await _open_events(stack, secure, task_id, token)).status_code == 200
        refused = await secure.get(f"/lmsp/v1/tasks/{task_id}/events", headers=bearer(token))
        assert_problem(refused, 429, "too_many_streams")
        assert refused.headers["retry-after"]
        # a refused streaming response leaves no task behind
        direct = await secure.post("/lmsp/v1/responses", json=body(stream=True), headers=bearer(token))
        assert_problem(direct, 429, "too_many_streams")
        assert await tasks_of(redis, principal) == [task_id]
        # the limit is per principal
        other_task = await _queued_task(secure, other)
        assert (await _open_events(stack, secure, other_task, other)).status_code == 200
    # closed streams give their slots back
    await _eventually_opens(secure, task_id, token, timeout=10)
    for tok, task in ((token, task_id), (other, other_task)):
        await secure.post(f"/lmsp/v1/tasks/{task}/cancel", headers=bearer(tok))


@pytest_asyncio.fixture
async def short_lease_api(redis_server: RedisServer, models_file: str) -> AsyncIterator[Api]:
    server = Api(redis_server.url, models_file=models_file, auth="tokens", max_streams=2, stream_lease=1.5,
                 sse_heartbeat=1).start()
    yield server
    server.stop()


async def test_stream_slots_count_across_processes_and_lapse_after_a_crash(
        short_lease_api: Api, secure: httpx.AsyncClient, make_token: TokenFactory) -> None:
    token, _ = await make_token()
    task_id = await _queued_task(secure, token)
    async with AsyncExitStack() as stack, httpx.AsyncClient(base_url=short_lease_api.url, timeout=30) as other:
        for _ in range(2):
            assert (await _open_events(stack, other, task_id, token)).status_code == 200
        # longer than the lease: the holding process renews the slots, and the other API process sees them
        await asyncio.sleep(4)
        assert_problem(await secure.get(f"/lmsp/v1/tasks/{task_id}/events", headers=bearer(token)), 429,
                       "too_many_streams")
        short_lease_api.kill()  # no chance to give the slots back
        await _eventually_opens(secure, task_id, token, timeout=10)
    await secure.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=bearer(token))


def test_per_principal_limits_default_on_with_tokens_and_off_without() -> None:
    assert (Settings().principal_rate_limit, Settings().principal_max_streams) == (600, 32)
    local = Settings(auth="none")
    assert (local.principal_rate_limit, local.principal_max_streams) == (0, 0)
    # set explicitly, a limit applies in either mode
    assert Settings(auth="none", rate_limit=7, max_streams=3).principal_max_streams == 3
    assert Settings(auth="none", rate_limit=7).principal_rate_limit == 7
    assert Settings(rate_limit=0).principal_rate_limit == 0


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of the test's own: the local principal's counters stay out of the shared one."""
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


async def test_the_local_principal_is_not_limited_by_default(own_redis: RedisServer, models_file: str) -> None:
    # auth none and no LMSP_RATE_LIMIT / LMSP_MAX_STREAMS: the defaults of the service, not the tests'
    server = Api(own_redis.url, models_file=models_file, rate_limit=None, max_streams=None).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            for _ in range(0, TOKENS_RATE_LIMIT + 1, 50):  # more than a token holder may send in a window
                answers = await asyncio.gather(*(http.get("/lmsp/v1/models") for _ in range(50)))
                assert {answer.status_code for answer in answers} == {200}
            task = (await http.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"))).json()
            async with AsyncExitStack() as stack:
                streams = [await stack.enter_async_context(http.stream("GET", f"/lmsp/v1/tasks/{task['id']}/events"))
                           for _ in range(TOKENS_MAX_STREAMS + 1)]
                assert {stream.status_code for stream in streams} == {200}
            await http.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    finally:
        server.stop()


async def test_the_local_principal_keeps_limits_set_explicitly(own_redis: RedisServer, models_file: str) -> None:
    server = Api(own_redis.url, models_file=models_file, rate_limit=5, max_streams=1).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            task = (await http.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"))).json()  # 1
            url = f"/lmsp/v1/tasks/{task['id']}/events"
            async with http.stream("GET", url) as first:  # 2
                assert first.status_code == 200
                assert_problem(await http.get(url), 429, "too_many_streams")  # 3
            await http.post(f"/lmsp/v1/tasks/{task['id']}/cancel")  # 4
            assert (await http.get("/lmsp/v1/models")).status_code == 200  # 5
            assert_problem(await http.get("/lmsp/v1/models"), 429, "rate_limited")
    finally:
        server.stop()
