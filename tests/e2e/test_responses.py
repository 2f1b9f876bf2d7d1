"""POST /lmsp/v1/responses end to end on tiny-random: synchronous (6.2) and streamed (6.3)."""

import asyncio
import json
from contextlib import aclosing

import httpx
import msgspec
import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.store import keys, registry
from lmsp_core.store.tasks import eventlog
from tests.backends import backend, client, eager_worker, make_token, redis, redis_settings, secure, served  # noqa: F401 (fixtures: both deployments)
from tests.support import body, collect, final_status, user_input

ULID_CHARS = set("0123456789ABCDEFGHJKMNPQRSTVWXYZ")


def assert_id(value: str, prefix: str) -> None:
    head, _, tail = value.partition("_")
    assert head == prefix and len(tail) == 26 and set(tail) <= ULID_CHARS, value


async def prompt_tokens(redis: aioredis.Redis, model: str, text: str) -> int:
    card = await registry.load_card(redis, model)
    assert card is not None
    request = msgspec.convert({"model": model, "input": user_input(text)}, wire.ResponseRequest)
    return len(PromptRenderer(card).prompt_ids(request))


async def test_synchronous_response_has_the_shape_of_6_2(client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    response = await client.post("/lmsp/v1/responses", json=body(text="Describe a local model service.",
                                                                  max_output_tokens=5))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["lmsp-version"] == "1.0"
    data = response.json()
    assert set(data) == {"id", "object", "created_at", "status", "model", "output", "usage", "error",
                         "incomplete_details"}
    assert_id(data["id"], "resp")
    assert data["object"] == "response" and data["model"] == "tiny-random"
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["error"] is None
    [item] = data["output"]
    assert_id(item["id"], "msg")
    assert item["type"] == "message" and item["role"] == "assistant"
    [part] = item["content"]
    assert part["type"] == "output_text" and part["text"]
    expected_input = await prompt_tokens(redis, "tiny-random", "Describe a local model service.")
    usage = dict(data["usage"])
    cached = usage.pop("input_tokens_details", {"cached_tokens": 0})  # the chat template's start, kept in a slot
    assert 0 <= cached["cached_tokens"] < expected_input
    assert usage == {"input_tokens": expected_input, "output_tokens": 5, "total_tokens": expected_input + 5}


async def test_greedy_is_the_default_and_is_deterministic(client: httpx.AsyncClient) -> None:
    first, second, zero = await asyncio.gather(
        client.post("/lmsp/v1/responses", json=body(text="Same prompt", max_output_tokens=12)),
        client.post("/lmsp/v1/responses", json=body(text="Same prompt", max_output_tokens=12)),
        client.post("/lmsp/v1/responses", json=body(text="Same prompt", max_output_tokens=12, temperature=0)),
    )
    texts = {r.json()["output"][0]["content"][0]["text"] for r in (first, second, zero)}
    assert len(texts) == 1


async def test_a_repeated_prompt_starts_from_its_cached_prefix(client: httpx.AsyncClient) -> None:
    text = "Asked twice, word for word"
    first, second = [(await client.post("/lmsp/v1/responses", json=body(text=text, max_output_tokens=6))).json()
                     for _ in range(2)]
    assert second["output"][0]["content"] == first["output"][0]["content"]
    usage = second["usage"]
    assert usage["input_tokens_details"] == {"cached_tokens": usage["input_tokens"] - 1}
    assert first["usage"].get("input_tokens_details", {"cached_tokens": 0})["cached_tokens"] < usage["input_tokens"] - 1


async def test_sampling_with_temperature(client: httpx.AsyncClient) -> None:
    texts = set()
    for _ in range(3):
        response = await client.post("/lmsp/v1/responses", json=body(max_output_tokens=8, temperature=1.5))
        assert response.status_code == 200
        texts.add(response.json()["output"][0]["content"][0]["text"])
    assert len(texts) > 1  # 3 random draws of 8 tokens from a 49k vocabulary


async def test_stream_follows_6_3(client: httpx.AsyncClient) -> None:
    async with client.stream("POST", "/lmsp/v1/responses", json=body(max_output_tokens=20, stream=True)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["lmsp-version"] == "1.0"
        raw = (await response.aread()).decode()
    blocks = [block for block in raw.split("\r\n\r\n") if block.strip()] if "\r\n" in raw else \
        [block for block in raw.split("\n\n") if block.strip()]
    events = []
    for block in blocks:
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        assert set(lines) == {"id", "event", "data"}
        events.append((int(lines["id"]), lines["event"], json.loads(lines["data"])))
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    names = [e[1] for e in events]
    assert names[:2] == [wire.CREATED, wire.ITEM_ADDED]
    assert set(names[2:-2]) == {wire.TEXT_DELTA}
    assert names[-2:] == [wire.ITEM_DONE, wire.INCOMPLETE]
    created, added, *deltas, done, final = [e[2] for e in events]
    rid = created["response_id"]
    assert_id(rid, "resp")
    assert created == {"response_id": rid, "status": "in_progress"}
    item_id = added["item"]["id"]
    assert added == {"response_id": rid, "output_index": 0,
                     "item": {"type": "message", "id": item_id, "role": "assistant", "content": []}}
    assert all(set(d) == {"response_id", "item_id", "delta"} and d["item_id"] == item_id for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert done["item"]["content"] == [{"type": "output_text", "text": text}]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 20


async def test_stream_and_sync_produce_the_same_text(client: httpx.AsyncClient) -> None:
    events = await collect(client, "POST", "/lmsp/v1/responses", json=body(text="Parity", max_output_tokens=30,
                                                                            stream=True))
    streamed = "".join(e.data["delta"] for e in events if e.event == wire.TEXT_DELTA)
    response = await client.post("/lmsp/v1/responses", json=body(text="Parity", max_output_tokens=30))
    assert response.json()["output"][0]["content"][0]["text"] == streamed


async def test_deltas_never_split_a_character(client: httpx.AsyncClient) -> None:
    # enough random tokens to meet byte-level tokens that form multi-byte characters
    events = await collect(client, "POST", "/lmsp/v1/responses",
                           json=body(text="Unicode: é 世界 😀", max_output_tokens=400, stream=True, temperature=1.0))
    deltas = [e.data["delta"] for e in events if e.event == wire.TEXT_DELTA]
    for delta in deltas:
        delta.encode("utf-8")  # a lone surrogate (half a character) would not encode
    done = next(e for e in events if e.event == wire.ITEM_DONE)
    assert "".join(deltas) == done.data["item"]["content"][0]["text"]


async def test_closing_a_direct_stream_cancels_its_task(client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    received, response_id = 0, ""
    async with client.stream("POST", "/lmsp/v1/responses", json=body(max_output_tokens=1000, stream=True)) as stream, \
            aclosing(stream.aiter_lines()) as lines:
        async for line in lines:
            if line.startswith("data: ") and not response_id:
                response_id = json.loads(line[6:])["response_id"]
            received += line.startswith("id: ")
            if received == 5:
                break
    task = await final_status(redis, response_id)
    assert task[b"status"] == b"cancelled"
    assert task[b"kind"] == b"direct"
    generated = len(await redis.get(keys.token_ids(task[b"id"].decode())) or b"") // 4
    assert generated < 1000
    last = await eventlog.last_event(redis, task[b"id"].decode(), response_id)
    assert last is not None and last.name == wire.CANCELLED


async def test_disconnecting_a_synchronous_request_cancels_its_task(client: httpx.AsyncClient,
                                                                    redis: aioredis.Redis) -> None:
    marker = "sync-disconnect-marker"
    try:
        await client.post("/lmsp/v1/responses", json=body(text=marker, max_output_tokens=1000), timeout=0.3)
    except httpx.ReadTimeout:
        pass
    else:
        raise AssertionError("the request should still have been running")
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline:
        async for key in redis.scan_iter(match="lmsp:task:{*}", count=1000):
            if key.endswith(b"}") and marker.encode() in (await redis.hget(key, "request") or b""):
                status = await redis.hget(key, "status")
                if status == b"cancelled":
                    return
        await asyncio.sleep(0.1)
    raise AssertionError("the synchronous task was not cancelled")
