"""Idempotency-Key on POST /responses and POST /tasks: one generation per key and body, per principal."""

import asyncio
import json
from contextlib import aclosing
from typing import Any

import httpx
import redis.asyncio as aioredis

from lmsp_core.store import keys
from lmsp_core.store.tasks import queue
from tests.backends import backend, client, eager_worker, make_token, redis, redis_settings, secure, served  # noqa: F401 (fixtures: both deployments)
from tests.support import TokenFactory, assert_problem, bearer, body, collect, tasks_of


def headers(token: str, key: str) -> dict[str, str]:
    return {**bearer(token), "Idempotency-Key": key}


async def test_twenty_concurrent_identical_tasks_make_one(secure: httpx.AsyncClient, make_token: TokenFactory,
                                                          redis: aioredis.Redis) -> None:
    token, principal = await make_token()
    request = body(model="tiny-unserved")
    depth = await queue.depth(redis, "tiny-unserved")
    answers = await asyncio.gather(*[
        secure.post("/lmsp/v1/tasks", json=request, headers=headers(token, "twenty")) for _ in range(20)])
    assert all(a.status_code == 202 for a in answers), [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 19
    assert await tasks_of(redis, principal) == [answers[0].json()["id"]]
    assert await queue.depth(redis, "tiny-unserved") == depth + 1
    await secure.post(f"/lmsp/v1/tasks/{answers[0].json()['id']}/cancel", headers=bearer(token))


async def test_concurrent_synchronous_repeats_share_one_generation(
        secure: httpx.AsyncClient, make_token: TokenFactory, redis: aioredis.Redis) -> None:
    token, principal = await make_token()
    request = body(text="Count to ten", max_output_tokens=24)
    answers = await asyncio.gather(*[
        secure.post("/lmsp/v1/responses", json=request, headers=headers(token, "sync")) for _ in range(5)])
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert len({a.content for a in answers}) == 1  # the same response object, byte for byte
    assert len(await tasks_of(redis, principal)) == 1
    later = await secure.post("/lmsp/v1/responses", json=request, headers=headers(token, "sync"))
    assert later.content == answers[0].content and later.headers["idempotent-replayed"] == "true"


async def test_streaming_repeat_relays_the_same_events(secure: httpx.AsyncClient, make_token: TokenFactory,
                                                       redis: aioredis.Redis) -> None:
    token, principal = await make_token()
    request = body(max_output_tokens=12, stream=True)
    first = await collect(secure, "POST", "/lmsp/v1/responses", json=request, headers=headers(token, "stream"))
    again = await collect(secure, "POST", "/lmsp/v1/responses", json=request, headers=headers(token, "stream"))
    assert [(e.id, e.event, e.data) for e in again] == [(e.id, e.event, e.data) for e in first]
    assert first[-1].event == "response.completed" or first[-1].event == "response.incomplete"
    # stream is not part of the fingerprint: a synchronous repeat gets the same generation's response
    sync = await secure.post("/lmsp/v1/responses", json=request | {"stream": False}, headers=headers(token, "stream"))
    assert sync.status_code == 200 and sync.json()["id"] == first[0].data["response_id"]
    assert len(await tasks_of(redis, principal)) == 1


async def test_a_dropped_idempotent_stream_keeps_generating(secure: httpx.AsyncClient,
                                                            make_token: TokenFactory) -> None:
    token, _ = await make_token()
    request = body(max_output_tokens=200, stream=True)
    async with secure.stream("POST", "/lmsp/v1/responses", json=request, headers=headers(token, "drop")) as response:
        assert response.status_code == 200
        async with aclosing(response.aiter_lines()) as lines:
            async for line in lines:
                if line.startswith("data:"):
                    break  # hang up after the first event
    events = await collect(secure, "POST", "/lmsp/v1/responses", json=request, headers=headers(token, "drop"))
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[-1].event in ("response.completed", "response.incomplete")  # not cancelled


async def test_same_key_with_another_body_or_endpoint_is_refused(secure: httpx.AsyncClient,
                                                                 make_token: TokenFactory) -> None:
    token, _ = await make_token()
    original = body(model="tiny-unserved", text="one")
    created = await secure.post("/lmsp/v1/tasks", json=original, headers=headers(token, "k1"))
    assert created.status_code == 202
    # whitespace and key order are not part of the body's identity
    reordered = json.dumps(dict(reversed(list(original.items()))), indent=2)
    same = await secure.post("/lmsp/v1/tasks", content=reordered, headers=headers(token, "k1") | {
        "content-type": "application/json"})
    assert same.json()["id"] == created.json()["id"] and same.headers["idempotent-replayed"] == "true"
    changed = await secure.post("/lmsp/v1/tasks", json=body(model="tiny-unserved", text="two"),
                                headers=headers(token, "k1"))
    assert_problem(changed, 422, "idempotency_key_reused")
    elsewhere = await secure.post("/lmsp/v1/responses", json=original, headers=headers(token, "k1"))
    assert_problem(elsewhere, 422, "idempotency_key_reused")
    # the key is scoped per principal: another principal's same key is a new request
    other, _ = await make_token()
    theirs = await secure.post("/lmsp/v1/tasks", json=original, headers=headers(other, "k1"))
    assert theirs.status_code == 202 and theirs.json()["id"] != created.json()["id"]
    assert "idempotent-replayed" not in theirs.headers
    for tok, task in ((token, created), (other, theirs)):
        await secure.post(f"/lmsp/v1/tasks/{task.json()['id']}/cancel", headers=bearer(tok))


async def test_keys_expire_after_a_day_by_default(secure: httpx.AsyncClient, make_token: TokenFactory,
                                                  redis: aioredis.Redis) -> None:
    token, principal = await make_token()
    created = await secure.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"), headers=headers(token, "ttl"))
    names = [key async for key in redis.scan_iter(match=keys.idempotency(principal, "*"))]
    assert len(names) == 1
    assert 86_000_000 < await redis.pttl(names[0]) <= 86_400_000
    await secure.post(f"/lmsp/v1/tasks/{created.json()['id']}/cancel", headers=bearer(token))


async def test_malformed_keys(secure: httpx.AsyncClient, make_token: TokenFactory) -> None:
    token, _ = await make_token()
    bad: list[Any] = ["", "x" * 256, "with space", "tab\tkey"]
    for key in bad:
        response = await secure.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"), headers=headers(token, key))
        assert_problem(response, 400, "invalid_idempotency_key")
