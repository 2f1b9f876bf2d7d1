"""Workers die and tasks go on: SIGKILL at random tokens, a task that kills every worker, lost jobs,
SIGTERM hand-back, an API process killed under a follower, and a background response of the OpenAI
routes resumed through the official ``openai`` package after its worker was killed.

Two tiny-random workers share one Redis with short leases, so that a dead worker's task is
reclaimed within a couple of seconds; a killed worker is restarted at once.
"""

import asyncio
import json
import random
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
import pytest_asyncio

from lmsp_core import wire
from lmsp_core.settings import load_settings
from lmsp_core.store import keys
from lmsp_core.store.tasks import queue
from lmsp_core.store.tasks.records import TaskRecord, TaskStore
from lmsp_core.wire import ids
from tests.faults import Group, assert_exactly_once, text_of
from tests.support import Api, RedisServer, SseEvent, Worker, body, logged, sse_events, wait_for

MODEL = "tiny-random"
SETTINGS = {"lease_ttl": 1.5, "reaper_interval": 0.2, "max_attempts": 3, "shutdown_grace": 0}
PROMPTS = ["Hello there", "Tell me about the sea", "One, two, three", "Why is the sky blue?"]
# the tasks of a round start one after the other, so the earlier ones get more room to be cut short
RUN_TOKENS = [400, 320, 260, 200]
ROUNDS = 5  # of len(PROMPTS) runs each: 20 runs
CHARS_A_TOKEN = 4  # about, in tiny-random's text


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


@pytest_asyncio.fixture(scope="module")
async def references(group: Group) -> list[str]:
    """The uninterrupted text of each prompt."""
    return list(await asyncio.gather(*(group.reference(request(slot)) for slot in range(len(PROMPTS)))))


def request(slot: int) -> dict[str, object]:
    return body(MODEL, PROMPTS[slot], max_output_tokens=RUN_TOKENS[slot])


def restart(worker: Worker) -> None:
    """Kill -9 and start again at once, without waiting for it to be ready."""
    worker.kill()
    worker.start()


@pytest.mark.timeout(900)
async def test_kill_9_at_a_random_token_twenty_times(group: Group, references: list[str]) -> None:
    """Rounds of four tasks in the batch of one worker: each task starts once the one before reached
    a random point of its text, and the worker is killed when the last reached its own, so every task
    is cut at a token of its own (a delta carries the tokens between two appends), and one kill (and
    restart) serves four runs. The other worker is paused (SIGSTOP) while the round's tasks start, so
    that they all go to the one that is killed, and continued at the kill, to take them over. A task
    that ended before the kill (on a loaded machine) is checked all the same but does not count."""
    rng = random.Random(7)
    interrupted = 0
    for round_ in range(ROUNDS + 3):
        runs = await _round(group, rng, *group.workers[::1 if round_ % 2 == 0 else -1])
        for slot, (task_id, log, killed) in enumerate(runs):
            where = f"round {round_}, task {slot} ({task_id}), killed on {killed}"
            assert_exactly_once(log)
            assert text_of(log) == references[slot], where
            assert await group.log(task_id) == log, where  # a late reader replays what the follower saw
            if await group.attempts(task_id) >= 2:  # the kill interrupted it: another claim resumed it
                assert await group.field(task_id, "worker") != killed, where
                interrupted += 1
        if interrupted >= len(PROMPTS) * ROUNDS:
            return
    raise AssertionError(f"only {interrupted} runs were interrupted")


async def _round(group: Group, rng: random.Random, victim: Worker,
                 standby: Worker) -> list[tuple[str, list[SseEvent], str | None]]:
    await victim.ready()
    await standby.ready()
    followers: list[tuple[str, asyncio.Task[list[SseEvent]]]] = []
    standby.signal(signal.SIGSTOP)
    try:
        for slot in range(len(PROMPTS)):
            task_id = await group.create(request(slot))
            reached = asyncio.Event()
            at = rng.randint(2, 40) * CHARS_A_TOKEN
            followers.append((task_id, asyncio.create_task(_follow(group, task_id, at, reached))))
            await reached.wait()
        holders = {task_id: await group.field(task_id, "worker") for task_id, _ in followers}
        restart(victim)
    finally:
        standby.signal(signal.SIGCONT)
    return [(task_id, await follower, holders[task_id]) for task_id, follower in followers]


async def _follow(group: Group, task_id: str, at: int, reached: asyncio.Event) -> list[SseEvent]:
    """The task's log; ``reached`` is set once its text is ``at`` characters long (or it ended)."""
    log: list[SseEvent] = []
    async for event in sse_events(group.http, "GET", f"/lmsp/v1/tasks/{task_id}/events"):
        log += logged([event])
        if len(text_of(log)) >= at or event.event in wire.FINAL_EVENTS:
            reached.set()
    return log


async def test_a_task_that_kills_every_worker_fails_after_max_attempts(group: Group) -> None:
    await wait_for(lambda: _all_ready(group), what="workers ready")
    task_id = await group.create(body(MODEL, "deadly", max_output_tokens=600))
    kills = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, attempts, last = await group.redis.hmget(keys.task(task_id), ["status", "attempts", "last_event_id"])
        if status != b"in_progress" and status != b"queued":
            break
        # the first worker streams a little text first; the others die as soon as they took the task
        if status == b"in_progress" and int(attempts) > kills and (kills or int(last or 0) >= 5):
            restart(await group.holder(task_id))
            kills += 1
        await asyncio.sleep(0.02)
    assert kills == 3
    log = await group.log(task_id)
    assert_exactly_once(log, final=wire.FAILED)
    assert log[-1].data["error"]["code"] == "worker_lost"
    task = (await group.http.get(f"/lmsp/v1/tasks/{task_id}")).json()
    assert task["status"] == "failed" and task["error"]["code"] == "worker_lost"
    assert await group.attempts(task_id) == 4
    # the failed response keeps the message the stream delivered, cut short
    [added] = [e.data["item"] for e in log if e.event == wire.ITEM_ADDED]
    partial = {"type": "message", "id": added["id"], "role": "assistant",
               "content": [{"type": "output_text", "text": text_of(log)}], "status": "incomplete"}
    assert text_of(log) and log[-1].data["output"] == task["response"]["output"] == [partial]


async def test_a_task_whose_job_was_lost_still_runs(group: Group) -> None:
    """A task whose record exists but whose job does not (the API died between the two), and one
    whose job a worker started and died before claiming it."""
    store = TaskStore(group.redis, load_settings(lease_ttl=SETTINGS["lease_ttl"]))
    reference = await group.reference(body(MODEL, "lost", max_output_tokens=20))
    lost = await _record(store, body(MODEL, "lost", max_output_tokens=20))
    stuck = await _record(store, body(MODEL, "lost", max_output_tokens=20))
    # the state arq leaves when a worker dies between starting a job and claiming its task
    await group.redis.set(keys.arq_in_progress(keys.job_id(stuck, MODEL)), b"1", ex=3600)
    await queue.enqueue(group.redis, stuck, MODEL)
    for task_id in (lost, stuck):
        log = await group.log(task_id)
        assert_exactly_once(log)
        assert text_of(log) == reference
        assert await group.field(task_id, "job") == f"{keys.job_id(task_id, MODEL)}:1"
    assert await group.redis.zscore(keys.queue(MODEL), keys.job_id(stuck, MODEL)) is None  # the dead job is gone
    assert not await group.redis.exists(keys.arq_in_progress(keys.job_id(stuck, MODEL)))
    # the index forgets finished tasks
    await wait_for(lambda: _unindexed(store, [lost, stuck]), what="index entries dropped")


async def test_sigterm_hands_running_tasks_back(group: Group, references: list[str]) -> None:
    await wait_for(lambda: _all_ready(group), what="workers ready")
    task_id = await group.create(request(3))
    stopped: list[Worker] = []

    async def stop() -> None:
        stopped.append(await group.holder(task_id))
        stopped[0].signal(signal.SIGTERM)

    log = await group.follow_and_act(task_id, 80, stop)
    assert_exactly_once(log)
    assert text_of(log) == references[3]
    assert stopped[0].wait() == 0
    assert "handed back" in stopped[0].output()
    assert await group.attempts(task_id) == 1  # a hand-back is not a failed attempt
    assert group.worker_with_id(str(await group.field(task_id, "worker"))) is not stopped[0]
    stopped[0].start()


async def test_a_follower_moves_to_another_api_when_its_api_is_killed(group: Group, references: list[str]) -> None:
    doomed = Api(group.redis_server.url, **SETTINGS).start()
    task_id = await group.create(request(2))
    seen: list[SseEvent] = []
    async with httpx.AsyncClient(base_url=doomed.url, timeout=60) as client:
        try:
            async for event in sse_events(client, "GET", f"/lmsp/v1/tasks/{task_id}/events"):
                seen += logged([event])
                if len(text_of(seen)) >= 120 and doomed.process is not None:
                    doomed.kill()
        except httpx.TransportError:
            pass
    assert seen and seen[-1].id is not None and seen[-1].event not in wire.FINAL_EVENTS
    rest = await group.log(task_id, after=seen[-1].id)
    assert_exactly_once(seen + rest)
    assert text_of(seen + rest) == references[2]


async def _record(store: TaskStore, request: dict[str, object]) -> str:
    """A task record, entered in the index as the API does, and no job."""
    record = TaskRecord(id=ids.new_id(ids.TASK), model=MODEL, owner="local", kind="task", status="queued",
                        created_at=time.time(), response_id=ids.new_id(ids.RESPONSE),
                        request=wire.encoder.encode(msgspec.convert(request, wire.ResponseRequest)))
    await store.create(record)
    return record.id


async def _unindexed(store: TaskStore, task_ids: list[str]) -> bool:
    entries = await store.index.entries(MODEL)
    return not any(task_id in entries for task_id in task_ids)


async def _all_ready(group: Group) -> bool:
    for worker in group.workers:
        await worker.ready()
    return True


# long enough to be interrupted, and a grammar that ends it by itself (completed, not incomplete)
WORDS = {"type": "object", "properties": {"words": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                                    "minItems": 48, "maxItems": 48}},
         "required": ["words"], "additionalProperties": False}


async def test_an_openai_background_response_outlives_its_worker(group: Group) -> None:
    await wait_for(lambda: _all_ready(group), what="workers ready")
    request: dict[str, Any] = {"model": MODEL, "input": "List words.", "text": {"format": {
        "type": "json_schema", "name": "words", "schema": WORDS, "strict": True}}}
    async with openai.AsyncOpenAI(base_url=f"{group.apis[0].url}/v1", api_key="unused", max_retries=0) as sdk:
        reference = await sdk.responses.create(**request)
        assert reference.status == "completed"
        stream = await sdk.responses.create(**request, background=True, stream=True)
        seen = []
        async for event in stream:  # until some of the answer's text came (a delta can carry several tokens)
            seen.append(event)
            if sum(len(e.delta) for e in seen if e.type == "response.output_text.delta") >= 40:
                break
        await stream.close()
        last = seen[-1].sequence_number
        for worker in group.workers:  # freeze both, so that the task cannot end before the kill
            worker.signal(signal.SIGSTOP)
        response_id = seen[0].response.id  # type: ignore[union-attr]
        task_id = (await group.redis.get(keys.response(response_id))).decode()
        victim = await group.holder(task_id)
        killed = await group.field(task_id, "worker")
        victim.kill()  # SIGKILL
        for worker in group.workers:
            if worker is not victim:
                worker.signal(signal.SIGCONT)
        victim.start()
        # resumed with the SDK's helper, which also assembles the final response
        async with sdk.responses.stream(response_id=response_id, starting_after=last) as resumed:
            rest = [event async for event in resumed]
            final = await resumed.get_final_response()
        whole = [event async for event in await sdk.responses.retrieve(response_id, stream=True)]
    numbers = [event.sequence_number for event in seen + rest]
    assert numbers == list(range(len(numbers))) == [event.sequence_number for event in whole]
    assert [event.type for event in seen + rest] == [event.type for event in whole]
    text = "".join(event.delta for event in seen + rest if event.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == reference.output_text == text
    jsonschema.validate(json.loads(final.output_text), WORDS)
    assert await group.attempts(task_id) >= 2 and await group.field(task_id, "worker") != killed


TURNS = 20
KILLED_TURN = 9


async def _killed_turn(group: Group, sdk: openai.AsyncOpenAI, conversation_id: str, text: str) -> Any:
    """A background response of the conversation whose worker is SIGKILLed mid-generation; its task
    runs again on the other worker. Returns the final response."""
    stream = await sdk.responses.create(model=MODEL, conversation=conversation_id, input=text,
                                        max_output_tokens=300, background=True, stream=True)
    seen = []
    async for event in stream:  # until some of the answer's text came
        seen.append(event)
        if sum(len(e.delta) for e in seen if e.type == "response.output_text.delta") >= 40:
            break
    await stream.close()
    for worker in group.workers:  # freeze both, so that the task cannot end before the kill
        worker.signal(signal.SIGSTOP)
    response_id = seen[0].response.id
    task_id = (await group.redis.get(keys.response(response_id))).decode()
    victim = await group.holder(task_id)
    killed = await group.field(task_id, "worker")
    victim.kill()
    for worker in group.workers:
        if worker is not victim:
            worker.signal(signal.SIGCONT)
    victim.start()
    while (final := await sdk.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        await asyncio.sleep(0.1)
    assert await group.attempts(task_id) >= 2 and await group.field(task_id, "worker") != killed
    return final


async def test_a_conversation_of_twenty_responses_one_killed_lists_each_item_once(group: Group) -> None:
    """The issue's check: 20 responses continue a conversation, one of them while its worker is
    SIGKILLed; the conversation lists their 40 items (input, output) in order, none twice."""
    await wait_for(lambda: _all_ready(group), what="workers ready")
    async with openai.AsyncOpenAI(base_url=f"{group.apis[0].url}/v1", api_key="unused", max_retries=0) as sdk:
        conversation = await sdk.conversations.create()
        responses = []
        for turn in range(TURNS):
            text = f"Turn {turn}: go on."
            if turn == KILLED_TURN:
                responses.append(await _killed_turn(group, sdk, conversation.id, text))
            else:
                responses.append(await sdk.responses.create(model=MODEL, conversation=conversation.id, input=text,
                                                            max_output_tokens=4))
        items = [item async for item in sdk.conversations.items.list(conversation.id, order="asc", limit=7)]
    assert len(items) == 2 * TURNS and len({item.id for item in items}) == 2 * TURNS
    assert [item.role for item in items] == ["user", "assistant"] * TURNS
    assert [item.content[0].text for item in items[::2]] == [f"Turn {turn}: go on." for turn in range(TURNS)]
    assert [item.id for item in items[1::2]] == [response.output[0].id for response in responses]
    assert ["".join(part.text for part in item.content) for item in items[1::2]] == [
        response.output_text for response in responses]
    assert all(response.conversation.id == conversation.id for response in responses)
