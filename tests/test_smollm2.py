"""The default model, SmolLM2-135M-Instruct from its GGUF, end to end (slower: real weights)."""

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from lmsp_core import wire
from tests.support import Api, RedisServer, Worker, collect, user_input

pytestmark = pytest.mark.smollm2

MODEL = "smollm2:135m-instruct"

# the request of spec section 6.1, with the service's default model
EXAMPLE: dict[str, Any] = {
    "model": MODEL,
    "input": user_input("Describe a local model service in one sentence."),
    "stream": False,
    "max_output_tokens": 512,
    "temperature": 0.7,
    "response_format": {"type": "text"},
    "store": True,
}


@pytest_asyncio.fixture(scope="module")
async def smol(redis_server: RedisServer, api: Api) -> AsyncIterator[httpx.AsyncClient]:
    worker = Worker(redis_server.url, [MODEL])
    worker.start()
    try:
        await worker.ready(timeout=300)
        async with httpx.AsyncClient(base_url=api.url, timeout=300) as http:
            yield http
    finally:
        worker.stop()


async def test_the_6_1_example_gets_a_6_2_response(smol: httpx.AsyncClient) -> None:
    response = await smol.post("/lmsp/v1/responses", json=EXAMPLE, headers={"LMSP-Version": "1.0",
                                                                            "Idempotency-Key": "01J8M5T7Z2K4N6Q8"})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "response" and data["model"] == MODEL
    assert data["status"] == "completed" and data["incomplete_details"] is None and data["error"] is None
    text = data["output"][0]["content"][0]["text"]
    assert len(text.split()) >= 3
    usage = data["usage"]
    assert usage["input_tokens"] > 20 and 0 < usage["output_tokens"] < 512
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_the_6_1_example_streams_as_6_3(smol: httpx.AsyncClient) -> None:
    events = await collect(smol, "POST", "/lmsp/v1/responses", json=EXAMPLE | {"stream": True, "temperature": 0})
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert [e.event for e in events[:2]] == [wire.CREATED, wire.ITEM_ADDED]
    assert events[-1].event == wire.COMPLETED and events[-2].event == wire.ITEM_DONE
    text = "".join(e.data["delta"] for e in events if e.event == wire.TEXT_DELTA)
    assert text.strip() and events[-2].data["item"]["content"][0]["text"] == text
    # greedy: the synchronous answer is the same text
    sync = await smol.post("/lmsp/v1/responses", json=EXAMPLE | {"temperature": 0})
    assert sync.json()["output"][0]["content"][0]["text"] == text


async def test_max_output_tokens_5_is_incomplete_with_5_tokens(smol: httpx.AsyncClient) -> None:
    response = await smol.post("/lmsp/v1/responses", json=EXAMPLE | {"max_output_tokens": 5})
    data = response.json()
    assert data["status"] == "incomplete"
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["usage"]["output_tokens"] == 5
    assert data["output"][0]["content"][0]["text"]
