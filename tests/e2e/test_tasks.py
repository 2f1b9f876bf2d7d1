"""The tasks API (6.4): background generation, resumable event streams, cancellation."""

import asyncio
import re
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.store import keys
from tests.backends import backend, client, eager_worker, make_token, redis, redis_settings, secure, served  # noqa: F401 (fixtures: both deployments)
from tests.support import (
    Api,
    SseEvent,
    Worker,
    assert_complete_log,
    assert_problem,
    body,
    collect,
    final_status,
    logged,
    sse_events,
)


async def create(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post("/lmsp/v1/tasks", json=body(**fields))
    assert response.status_code == 202, response.text
    task: dict[str, Any] = response.json()
    assert response.headers["location"] == f"/lmsp/v1/tasks/{task['id']}"
    return task


async def events(client: httpx.AsyncClient, task_id: str, **kwargs: Any) -> list[SseEvent]:
    return logged(await collect(client, "GET", f"/lmsp/v1/tasks/{task_id}/events", **kwargs))


async def test_create_returns_a_queued_task_object(client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=3)
    assert set(task) == {"id", "object", "status", "created_at", "started_at", "finished_at", "model",
                         "response_id", "response", "error"}
    assert task["id"].startswith("task_") and task["response_id"].startswith("resp_")
    assert task["object"] == "task" and task["status"] == "queued" and task["model"] == "tiny-random"
    assert task["response"] is None and task["error"] is None
    log = await events(client, task["id"])
    assert_complete_log(log)
    final = (await client.get(f"/lmsp/v1/tasks/{task['id']}")).json()
    assert final["status"] == "incomplete" and final["finished_at"] >= final["started_at"] >= final["created_at"]
    assert final["response"]["id"] == task["response_id"]
    assert final["response"]["output"][0]["content"][0]["text"] == "".join(
        e.data["delta"] for e in log if e.event == wire.TEXT_DELTA)


async def test_resume_with_last_event_id_and_after(client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=300)
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    first: list[SseEvent] = []
    async for event in sse_events(client, "GET", url):
        first += logged([event])
        if len(first) == 7:
            break  # drop the connection mid-stream
    k = first[-1].id
    assert k == 7
    by_header = logged(await collect(client, "GET", url, headers={"Last-Event-ID": str(k)}))
    by_query = logged(await collect(client, "GET", f"{url}?after={k}"))
    for rest in (by_header, by_query):
        assert_complete_log(first + rest)
    assert by_header == by_query
    # after the task is final: the rest is replayed and the stream closes
    assert await collect(client, "GET", f"{url}?after={k}") == by_query
    # `after` wins over the header
    assert await collect(client, "GET", f"{url}?after=10", headers={"Last-Event-ID": "3"}) == by_query[3:]
    # no cursor means from the start
    assert_complete_log(logged(await collect(client, "GET", url)))


async def test_cursor_at_or_beyond_the_end_of_a_final_task(client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=2)
    log = await events(client, task["id"])
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    assert await collect(client, "GET", f"{url}?after={log[-1].id}") == []
    assert await collect(client, "GET", f"{url}?after=999") == []


async def test_cursor_beyond_the_end_of_a_running_task_waits(client: httpx.AsyncClient, eager_worker: Worker) -> None:
    task = await create(client, model="tiny-eager", max_output_tokens=1000)  # an event a token
    # asked at once, event 300 does not exist yet: the stream waits for it
    tail = logged(await collect(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events?after=300"))
    log = await events(client, task["id"])
    assert len(log) > 300 and tail == log[300:]


BEYOND_REDIS = ["99999999999999999999999", str(2**64), "1" + "0" * 5000]


@pytest.mark.parametrize("cursor", ["-1", "abc", "1.5", "2x", "٣", "+3", " ", *BEYOND_REDIS],
                         ids=["-1", "abc", "1.5", "2x", "arabic-3", "+3", "space", "1e23", "2^64", "5001-digits"])
async def test_malformed_cursors(client: httpx.AsyncClient, cursor: str) -> None:
    task = await create(client, max_output_tokens=1)
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    assert_problem(await client.get(url, params={"after": cursor}), 400, "invalid_cursor")
    if cursor.isascii() and cursor.strip():  # (httpx sends no header of blanks)
        assert_problem(await client.get(url, headers={"Last-Event-ID": cursor}), 400, "invalid_cursor")


async def test_cursors_beyond_redis_are_refused_before_the_stream_even_on_a_running_task(
        client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=1000)
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    for cursor in BEYOND_REDIS[:2]:
        problem = assert_problem(await client.get(url, params={"after": cursor}), 400, "invalid_cursor")
        assert str(2**64 - 1) in problem["detail"]
        assert_problem(await client.get(url, headers={"Last-Event-ID": cursor}), 400, "invalid_cursor")
    # the largest id a Redis stream can hold is a cursor like any other: nothing after it
    await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    assert await collect(client, "GET", f"{url}?after={2**64 - 1}") == []
    assert await collect(client, "GET", url, headers={"Last-Event-ID": "0" * 30 + "3"}) == (await events(
        client, task["id"]))[3:]


async def test_an_empty_after_is_absent_and_the_header_applies(client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=20)
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    log = await events(client, task["id"])
    assert_complete_log(log)
    assert await collect(client, "GET", f"{url}?after=", headers={"Last-Event-ID": "4"}) == log[4:]
    assert await collect(client, "GET", url, params={"after": ""}, headers={"Last-Event-ID": "4"}) == log[4:]
    assert await collect(client, "GET", f"{url}?after=") == log  # nor header: from the start
    assert await collect(client, "GET", f"{url}?after=2", headers={"Last-Event-ID": "4"}) == log[2:]


async def test_unknown_tasks(client: httpx.AsyncClient) -> None:
    for task_id in ("task_01J8M6Q4W2T7N5R3V9X1Z8B0DF", "nonsense", "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"):
        assert_problem(await client.get(f"/lmsp/v1/tasks/{task_id}"), 404, "task_not_found")
        assert_problem(await client.get(f"/lmsp/v1/tasks/{task_id}/events"), 404, "task_not_found")
        assert_problem(await client.post(f"/lmsp/v1/tasks/{task_id}/cancel"), 404, "task_not_found")


async def test_fifty_readers_get_identical_complete_sequences(client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=200)
    url = f"/lmsp/v1/tasks/{task['id']}/events"

    async def read(delay: float) -> list[SseEvent]:
        await asyncio.sleep(delay)
        return logged(await collect(client, "GET", url))

    logs = await asyncio.gather(*(read(i * 0.01) for i in range(50)))
    assert_complete_log(logs[0])
    assert all(log == logs[0] for log in logs)


async def _raw_lines(client: httpx.AsyncClient, url: str, task_id: str) -> list[str]:
    """Every line of a queued task's stream: two keep-alives while it waits, then it is cancelled."""
    lines: list[str] = []
    async with client.stream("GET", url) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if line == ": keep-alive" and lines.count(line) == 2:
                assert (await client.post(f"/lmsp/v1/tasks/{task_id}/cancel")).status_code == 200
    return lines


def _blocks(lines: list[str]) -> list[list[str]]:
    """The stream's events (a blank line ends one), comment lines left out."""
    blocks, block = [], []
    for line in lines:
        if line == "":
            if block:
                blocks.append(block)
            block = []
        elif not line.startswith(":"):
            block.append(line)
    return blocks


async def test_every_event_has_an_id_and_the_queue_position_is_a_comment(client: httpx.AsyncClient) -> None:
    task = await create(client, model="tiny-unserved")
    lines = await _raw_lines(client, f"/lmsp/v1/tasks/{task['id']}/events", task["id"])
    positions = [i for i, line in enumerate(lines) if line.startswith(": queued")]
    # at the start and after each keep-alive (the last one may find the task cancelled already)
    assert len(positions) >= 2 and all(re.fullmatch(r": queued [1-9][0-9]*", lines[i]) for i in positions)
    # a block of its own, as the keep-alives: never glued to the next event
    assert all(lines[i + 1] == "" for i in positions)
    assert not any("task.queued" in line for line in lines)
    assert [block[:2] for block in _blocks(lines)] == [["id: 1", f"event: {wire.CANCELLED}"]]
    # what an SSE parser makes of it: the events of the log, each with its id
    assert [(e.id, e.event) for e in await collect(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events")] == [
        (1, wire.CANCELLED)]


async def test_queue_events_when_asked_for(client: httpx.AsyncClient) -> None:
    task = await create(client, model="tiny-unserved")
    lines = await _raw_lines(client, f"/lmsp/v1/tasks/{task['id']}/events?queue_events=true", task["id"])
    assert not any(line.startswith(": queued") for line in lines)
    blocks = _blocks(lines)
    notices, logged_events = blocks[:-1], blocks[-1]
    assert len(notices) >= 2 and logged_events[:2] == ["id: 1", f"event: {wire.CANCELLED}"]
    for notice in notices:  # extra events outside the log: no id
        assert notice[0] == "event: task.queued" and len(notice) == 2
        data = msgspec.json.decode(notice[1].removeprefix("data: "))
        assert data == {"task_id": task["id"], "status": "queued", "queue_position": data["queue_position"]}
        assert data["queue_position"] >= 1
    assert_problem(await client.get(f"/lmsp/v1/tasks/{task['id']}/events?queue_events=maybe"), 400,
                   "invalid_request")


async def test_cancel_a_queued_task(client: httpx.AsyncClient) -> None:
    task = await create(client, model="tiny-unserved")
    cancelled = await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["response"]["status"] == "cancelled"
    log = await events(client, task["id"])
    assert [(e.id, e.event) for e in log] == [(1, wire.CANCELLED)]
    again = await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    assert again.json() == cancelled.json()


async def test_cancel_a_running_task(client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=1000)
    url = f"/lmsp/v1/tasks/{task['id']}/events"
    async for event in sse_events(client, "GET", url):
        if event.event == wire.TEXT_DELTA:  # running
            break
    cancelled = (await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")).json()
    assert cancelled["status"] == "cancelled"
    log = await events(client, task["id"])
    assert [e.id for e in log] == list(range(1, len(log) + 1))
    assert [e.event for e in log[-2:]] == [wire.ITEM_DONE, wire.CANCELLED]
    assert len(log) < 1000
    text = "".join(e.data["delta"] for e in log if e.event == wire.TEXT_DELTA)
    assert cancelled["response"]["status"] == "cancelled"
    assert cancelled["response"]["output"][0]["content"][0]["text"] == text
    # cancelling a final task changes nothing
    assert (await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")).json() == cancelled


async def test_retention_settings_are_key_expiries(client: httpx.AsyncClient, redis: Any) -> None:
    task = await create(client, max_output_tokens=2)
    await events(client, task["id"])
    from lmsp_core.store import keys

    assert 3500 < await redis.ttl(keys.events(task["id"])) <= 3600
    assert 86000 < await redis.ttl(keys.task(task["id"])) <= 86400


async def test_a_finished_log_is_stored_compactly_and_replays_whole(client: httpx.AsyncClient, redis: Any,
                                                                   eager_worker: Worker) -> None:
    from lmsp_core.store import keys

    task = await create(client, model="tiny-eager", max_output_tokens=200)  # an event a token
    streamed = await events(client, task["id"])
    assert_complete_log(streamed)
    key = keys.events(task["id"])
    per_event = await redis.memory_usage(key, samples=0) / await redis.xlen(key)
    assert per_event <= 150  # codes instead of names, no repeated response id, nodes rebuilt to size
    assert await events(client, task["id"]) == streamed  # the rebuilt log replays the same bytes
    assert 3500 < await redis.ttl(key) <= 3600  # and keeps its retention


def test_stored_form_of_events_round_trips() -> None:
    from lmsp_core.store.tasks import eventlog

    rid = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
    cases = [
        (wire.TEXT_DELTA, wire.encoder.encode(wire.OutputTextDelta(response_id=rid, item_id="msg_1", delta="a\nb"))),
        (wire.CREATED, wire.encoder.encode(wire.ResponseCreated(response_id=rid))),
        ("vendor.extra", b'{"response_id":"' + rid.encode() + b'","x":1}'),  # unknown names pass as they are
        (wire.ITEM_DONE, b'{"item":{"response_id":"' + rid.encode() + b'"}}'),  # not leading: kept whole
        (wire.COMPLETED, b'{"response_id":"resp_OTHER","status":"completed"}'),
    ]
    for name, data in cases:
        code, stored = eventlog.pack(name, data, rid)
        assert len(stored) <= len(data)
        assert eventlog.unpack(code.encode(), stored, rid) == (name, data)
    assert eventlog.pack(wire.TEXT_DELTA, cases[0][1], rid)[0] == "d"
    assert eventlog.pack(*cases[0], rid)[1].startswith(b',"item_id"')


async def test_the_api_renders_the_prompt_once_and_the_worker_uses_it(client: httpx.AsyncClient,
                                                                      redis: Any) -> None:
    task = await create(client, max_output_tokens=4)
    stored = await redis.hgetall(f"lmsp:task:{{{task['id']}}}")
    assert len(stored[b"prompt"]) % 4 == 0 and len(stored[b"prompt"]) > 0
    # the card the API rendered with (its digest kept once, not hashed per request) is the worker's
    assert stored[b"prompt_card"] == await redis.get(keys.model_card_digest(task["model"]))
    final = [e for e in await events(client, task["id"]) if e.event in wire.FINAL_EVENTS][-1]
    usage = final.data["usage"]
    assert usage["input_tokens"] == len(stored[b"prompt"]) // 4  # the worker ran the API's prompt


async def test_a_cancel_reaches_the_worker_at_once_between_its_appends(api: Api, patient_worker: Worker,
                                                                       redis: aioredis.Redis) -> None:
    """The worker appends every 3 s, but hears of the cancellation at once (its cancel channel): the
    task ends within a step or so, not at the next append's reply. The bound leaves a loaded 2-core
    machine room (1.3 s seen beside the whole suite) and stays clear of that reply, 3 s after the
    first output."""
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
        task = await create(client, model="tiny-patient", max_output_tokens=8000)
        async for event in sse_events(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events"):
            if event.event == wire.TEXT_DELTA:
                break  # the first output goes out at once; the next append is 3 s away
        started = asyncio.get_running_loop().time()
        await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
        final = await final_status(redis, task["response_id"])
        assert final[b"status"] == b"cancelled"
        assert asyncio.get_running_loop().time() - started < 2.0


async def test_a_delta_carries_the_tokens_between_two_appends(client: httpx.AsyncClient) -> None:
    task = await create(client, max_output_tokens=300)
    log = await events(client, task["id"])
    deltas = [e for e in log if e.event == wire.TEXT_DELTA]
    final = (await client.get(f"/lmsp/v1/tasks/{task['id']}")).json()
    assert final["response"]["usage"]["output_tokens"] == 300
    assert len(deltas) < 300  # several tokens a delta: the model is faster than the flush interval
    assert "".join(e.data["delta"] for e in deltas) == final["response"]["output"][0]["content"][0]["text"]
