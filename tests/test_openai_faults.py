"""Background responses outlive what breaks under them, seen through the official ``openai`` package:
a stream cut mid-body and resumed with ``starting_after``, and a worker killed with SIGKILL
mid-response whose task another worker finishes. Both end with the events of an uninterrupted
reading (numbered 0..n, each once) and the text of an uninterrupted run.

A group of our own (one API, two tiny-random workers, short leases) so that a dead worker's task
is reclaimed within a couple of seconds.
"""

import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio
from openai.types.responses import ResponseStreamEvent

from lmsp_core import keys
from tests.faults import Group
from tests.proxy import CuttingProxy
from tests.support import Api, RedisServer, Worker

MODEL = "tiny-random"
SETTINGS = {"lease_ttl": 1.5, "reaper_interval": 0.2, "max_attempts": 3, "shutdown_grace": 0}
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
# long enough to be interrupted, and a grammar that ends it by itself (completed, not incomplete)
WORDS = {"type": "object", "properties": {"words": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                                    "minItems": 48, "maxItems": 48}},
         "required": ["words"], "additionalProperties": False}
FORMAT = {"format": {"type": "json_schema", "name": "words", "schema": WORDS, "strict": True}}


@pytest_asyncio.fixture(scope="module")
async def group() -> AsyncIterator[Group]:
    redis = RedisServer()
    redis.start()
    group = await Group.start(redis, [Api(redis.url, **SETTINGS)],
                              [Worker(redis.url, [MODEL], **SETTINGS) for _ in range(2)])
    try:
        yield group
    finally:
        await group.close()


@pytest_asyncio.fixture
async def sdk(group: Group) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=f"{group.apis[0].url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield client
    finally:
        await client.close()


def validated(event: Any) -> Any:
    return EVENTS.validate_python(event.to_dict())


def numbers(events: list[Any]) -> list[int]:
    return [event.sequence_number for event in events]


def text_of(events: list[Any]) -> str:
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


async def whole(sdk: openai.AsyncOpenAI, response_id: str) -> list[Any]:
    """An uninterrupted reading of the response's events, from the start."""
    return [validated(event) async for event in await sdk.responses.retrieve(response_id, stream=True)]


async def test_a_cut_stream_resumes_after_its_last_event(group: Group, sdk: openai.AsyncOpenAI) -> None:
    request: dict[str, Any] = {"model": MODEL, "input": "Tell me about the sea.", "max_output_tokens": 160}
    reference = (await sdk.responses.create(**request)).output_text
    seen: list[Any] = []
    with CuttingProxy(group.apis[0].port, cut_after=7000, match=b"/v1/responses") as proxy:
        flaky = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            stream = await flaky.responses.create(**request, background=True, stream=True)
            with pytest.raises(openai.APIConnectionError):
                async for event in stream:
                    seen.append(validated(event))
        finally:
            await flaky.close()
    assert proxy.cuts == 1 and seen and seen[-1].type != "response.incomplete"
    response_id, last = seen[0].response.id, seen[-1].sequence_number
    rest = [validated(event) async for event in await sdk.responses.retrieve(
        response_id, stream=True, starting_after=last)]
    assert numbers(seen + rest) == list(range(len(seen) + len(rest)))  # gapless, each once
    assert [event.to_dict() for event in seen + rest] == [event.to_dict() for event in await whole(sdk, response_id)]
    assert text_of(seen + rest) == reference == (await sdk.responses.retrieve(response_id)).output_text
    # the SDK's own resuming helper (it reads from the start and drops what it had)
    async with sdk.responses.stream(response_id=response_id, starting_after=last) as helper:
        assert numbers([event async for event in helper]) == numbers(rest)


async def test_a_worker_killed_mid_response(group: Group, sdk: openai.AsyncOpenAI) -> None:
    request: dict[str, Any] = {"model": MODEL, "input": "List words.", "text": FORMAT}
    reference = await sdk.responses.create(**request)
    assert reference.status == "completed"
    stream = await sdk.responses.create(**request, background=True, stream=True)
    seen: list[Any] = []
    async for event in stream:
        seen.append(validated(event))
        if event.sequence_number == 24:
            break
    await stream.close()
    for worker in group.workers:  # freeze both, so that the task cannot end before the kill
        worker.signal(signal.SIGSTOP)
    response_id = seen[0].response.id
    task_id = (await group.redis.get(keys.response(response_id))).decode()
    victim = await group.holder(task_id)
    killed = await group.field(task_id, "worker")
    victim.kill()  # SIGKILL
    for worker in group.workers:
        if worker is not victim:
            worker.signal(signal.SIGCONT)
    victim.start()
    # resumed with the SDK's helper, which also assembles the final response (its events are its own
    # objects, checked against an uninterrupted reading of the raw events below)
    async with sdk.responses.stream(response_id=response_id, starting_after=seen[-1].sequence_number) as resumed:
        rest = [event async for event in resumed]
        final = await resumed.get_final_response()
    assert numbers(seen + rest) == list(range(len(seen) + len(rest)))
    assert final.status == "completed" and final.output_text == reference.output_text == text_of(seen + rest)
    jsonschema.validate(json.loads(final.output_text), WORDS)
    assert await group.attempts(task_id) >= 2 and await group.field(task_id, "worker") != killed
    assert [(event.sequence_number, event.type) for event in seen + rest] == [
        (event.sequence_number, event.type) for event in await whole(sdk, response_id)]
