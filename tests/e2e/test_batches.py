"""OpenAI's Batch API on the durable tasks, driven through the official ``openai`` package
(docs/protocol.md, "Batches")."""

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest_asyncio
import redis.asyncio as aioredis

from lmsp_core.store import keys
from tests.support import (
    CHAT,
    Api,
    RedisServer,
    Worker,
    all_running,
    batch_lines,
    chat_line,
    jsonl,
    run_batch,
    until_final,
    wait_for,
)


async def test_a_thousand_lines_through_the_official_client(sdk: openai.AsyncOpenAI, api: Api) -> None:
    good = [chat_line(f"req-{n}", f"Count to {n}") for n in range(1000)]
    bad: list[Any] = [
        {"not": "a batch request"},
        {**chat_line("wrong-url", "hi"), "url": "/v1/embeddings"},
        chat_line("req-7", "a custom_id used twice"),
        chat_line("no-model", "hi", model="no-such-model"),
        {**chat_line("bad-param", "hi"), "body": {"model": "tiny-random", "messages": [], "max_tokens": 4}},
    ]
    _, batch = await run_batch(sdk, good[:500] + bad + good[500:])
    assert batch.status == "validating" and batch.endpoint == CHAT
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
        await wait_for(lambda: _running(sdk, batch.id), what="the batch to run")
        # an interactive request of the same owner, sent while the batch's lines queue
        first_token = await _time_to_first_token(http)
    done = await until_final(sdk, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (1005, 1000, 5)
    output = await batch_lines(sdk, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(1000))
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
    errors = {line["custom_id"]: line for line in await batch_lines(sdk, done.error_file_id)}
    assert set(errors) == {None, "wrong-url", "req-7", "no-model", "bad-param"}
    assert errors["wrong-url"]["error"]["code"] == "invalid_url"
    assert errors["req-7"]["error"]["code"] == "duplicate_custom_id"
    assert errors["no-model"]["response"]["status_code"] == 404
    assert errors["no-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["bad-param"]["response"]["status_code"] == 400
    # the interactive request did not wait for the batch: a few task lengths at most
    per_task = (time.monotonic() - started) / 1000
    assert first_token < max(2.0, 20 * per_task), (first_token, per_task)


async def _running(sdk: openai.AsyncOpenAI, batch_id: str) -> bool:
    batch = await sdk.batches.retrieve(batch_id)
    return batch.status == "in_progress" and batch.request_counts.completed > 20


async def _time_to_first_token(http: httpx.AsyncClient) -> float:
    started = time.monotonic()
    async with http.stream("POST", "/v1/chat/completions", json={
            "model": "tiny-random", "messages": [{"role": "user", "content": "Are you there?"}], "max_tokens": 4,
            "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.monotonic() - started
    raise AssertionError("no token")


async def test_lines_are_tasks_listed_with_their_batch(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    _, batch = await run_batch(sdk, [chat_line(f"t-{n}", "hi") for n in range(3)])
    await until_final(sdk, batch.id)
    tasks = (await client.get("/lmsp/v1/tasks", params={"limit": 100})).json()["data"]
    assert sum(task.get("batch_id") == batch.id for task in tasks) == 3
    listed = await sdk.batches.list(limit=100)
    assert batch.id in [item.id for item in listed.data]


async def test_cancel_stops_the_lines_that_have_not_run(sdk: openai.AsyncOpenAI) -> None:
    _, batch = await run_batch(sdk, [chat_line(f"c-{n}", "Tell me a long story", tokens=200) for n in range(300)])
    await wait_for(lambda: _some_done(sdk, batch.id), what="some lines to end")
    cancelling = await sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await until_final(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    output, errors = await batch_lines(sdk, done.output_file_id), await batch_lines(sdk, done.error_file_id)
    assert len(output) + len(errors) == 300 == done.request_counts.total
    assert len(output) == done.request_counts.completed and 0 < len(output) < 300
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert len({line["custom_id"] for line in output + errors}) == 300


async def _some_done(sdk: openai.AsyncOpenAI, batch_id: str) -> bool:
    return (await sdk.batches.retrieve(batch_id)).request_counts.completed >= 5


async def test_lines_not_started_in_the_window_expire(sdk: openai.AsyncOpenAI) -> None:
    _, batch = await run_batch(sdk, [chat_line(f"e-{n}", "Tell me a long story", tokens=300) for n in range(400)],
                               window="3s")
    done = await until_final(sdk, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    output, errors = await batch_lines(sdk, done.output_file_id), await batch_lines(sdk, done.error_file_id)
    assert len(output) + len(errors) == 400 and output and errors
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}


async def test_refusals(sdk: openai.AsyncOpenAI) -> None:
    source = await sdk.files.create(file=("r.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch")
    for fields, code in (({"endpoint": "/v1/embeddings"}, "unsupported_value"),
                         ({"completion_window": "48h"}, "unsupported_value"),
                         ({"input_file_id": "file_00000000000000000000000000"}, "file_not_found")):
        arguments = {"input_file_id": source.id, "endpoint": CHAT, "completion_window": "24h", **fields}
        try:
            await sdk.batches.create(**arguments)  # type: ignore[arg-type]
        except openai.APIStatusError as exc:
            assert exc.code == code, exc
        else:
            raise AssertionError(f"{fields} was accepted")
    try:
        await sdk.batches.retrieve("batch_00000000000000000000000000")
    except openai.NotFoundError as exc:
        assert exc.code == "batch_not_found"
    else:
        raise AssertionError("an unknown batch was found")


@pytest_asyncio.fixture
async def doomed(redis_server: RedisServer, models_file: str) -> AsyncIterator[tuple[Api, Worker]]:
    """An API process and a worker of tiny-random, both to be killed (the session's go on)."""
    api = Api(redis_server.url, models_file=models_file)
    worker = Worker(redis_server.url, ["tiny-random"], models_file=models_file, lease_ttl=1.5)
    async with all_running(api, worker):  # side by side
        yield api, worker


async def test_a_batch_outlives_a_killed_worker_and_api(doomed: tuple[Api, Worker], api: Api,
                                                         redis: aioredis.Redis, tiny_worker: Worker) -> None:
    doomed_api, doomed_worker = doomed
    lines = [chat_line(f"k-{n}", "Tell me about the sea", tokens=40) for n in range(200)]
    async with openai.AsyncOpenAI(base_url=f"{doomed_api.url}/v1", api_key="unused", max_retries=0) as first:
        _, batch = await run_batch(first, lines)
        await wait_for(lambda: _some_done(first, batch.id), what="some lines to end")
    doomed_worker.kill()
    doomed_api.kill()
    async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as other:
        done = await until_final(other, batch.id)
        output, errors = await batch_lines(other, done.output_file_id), await batch_lines(other, done.error_file_id)
    assert done.status == "completed" and not errors
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
    # each line had one task: the driver that took over found the tasks already made
    tasks = await redis.hvals(keys.batch_tasks(batch.id))  # type: ignore[misc]
    assert len(tasks) == len(set(tasks)) == 200


async def test_a_batch_cancelled_at_once_still_ends_every_line(sdk: openai.AsyncOpenAI) -> None:
    _, batch = await run_batch(sdk, [chat_line(f"n-{n}", "hi") for n in range(5)])
    await sdk.batches.cancel(batch.id)  # most likely still validating
    done = await until_final(sdk, batch.id)
    output, errors = await batch_lines(sdk, done.output_file_id), await batch_lines(sdk, done.error_file_id)
    assert done.status == "cancelled" and done.request_counts.total == 5 == len(output) + len(errors)
