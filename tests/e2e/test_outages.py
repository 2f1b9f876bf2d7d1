"""Redis crashes and restarts from its append-only file, a generation runs past its time limit, and
a worker stops on SIGTERM while its task can still finish within the grace period.

One Redis with AOF (fsync always), one API, and two workers: ``tiny-one`` runs one sequence at a
time (so a second task waits in the queue) and ``tiny-timeout`` has a 1.5 s time limit and a
context window that no generation fills within it.
"""

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio

from lmsp_core import wire
from lmsp_core.store import keys
from tests.faults import Group, assert_exactly_once, models_file, text_of, tiny
from tests.support import Api, RedisServer, SseEvent, Worker, assert_problem, body, logged, sse_events, wait_for

ONE = "tiny-one"
TIMED = "tiny-timeout"
MODELS = [tiny(ONE, max_batch_size=1),
          tiny(TIMED, max_batch_size=1, context_window=65536, max_output_tokens=60000,
               capabilities=["streaming", "conversations"])]
TIME_LIMIT = 1.5


@pytest_asyncio.fixture(scope="module")
async def group() -> AsyncIterator[Group]:
    path = models_file(MODELS)
    redis = RedisServer(appendonly=True)
    redis.start()
    # a long lease: a Redis outage of a few seconds must not cost the running task its lease
    common = {"models_file": path, "lease_ttl": 30}
    group = await Group.start(redis, [Api(redis.url, **common)], [
        Worker(redis.url, [ONE], shutdown_grace=30, **common),
        Worker(redis.url, [TIMED], job_timeout=TIME_LIMIT, **common),
    ])
    try:
        yield group
    finally:
        await group.close()
        Path(path).unlink()


async def test_a_generation_past_its_time_limit_is_stopped_and_the_worker_goes_on(group: Group) -> None:
    endless = await group.create(body(TIMED, "Go on forever", max_output_tokens=60000, store=True))
    after = await group.create(body(TIMED, "Next", max_output_tokens=3))
    log = await group.log(endless)
    assert_exactly_once(log, final=wire.FAILED)
    assert log[-1].data["error"]["code"] == "generation_timeout"
    assert text_of(log)  # it did generate until the limit
    task = (await group.http.get(f"/lmsp/v1/tasks/{endless}")).json()
    assert task["status"] == "failed" and task["error"]["code"] == "generation_timeout"
    await _assert_partial_output_kept(group, log, task)
    # the worker runs one sequence at a time: the next task runs only if the first really stopped
    assert_exactly_once(await group.log(after), final=wire.INCOMPLETE)
    assert group.workers[1].process is not None and group.workers[1].process.poll() is None


async def test_tasks_survive_a_redis_crash_and_everything_reconnects(group: Group) -> None:
    first, second = body(ONE, "Survive this", max_output_tokens=300), body(ONE, "Wait for it", max_output_tokens=50)
    references = await asyncio.gather(group.reference(first), group.reference(second))
    running = await group.create(first)
    queued = await group.create(second)  # waits: the worker runs one sequence at a time
    seen: list[SseEvent] = []
    async for event in sse_events(group.http, "GET", f"/lmsp/v1/tasks/{running}/events"):
        seen.append(event)
        if event.event == wire.TEXT_DELTA and len(text_of(seen)) >= 40 and group.redis_server.process is not None:
            group.redis_server.stop(signal.SIGKILL)
    # the follower's stream ended with an error event (its SSE id is the last event's: it has none)
    assert seen[-1].event == wire.ERROR and seen[-1].id == seen[-2].id
    assert seen[-1].data["error"]["code"] == "service_unavailable"
    await _assert_unavailable(group, running)

    group.redis_server.start()
    await wait_for(lambda: _answers(group, running), what="the API to reconnect")
    log = logged(seen[:-1]) + await group.log(running, after=seen[-2].id or 0)
    assert_exactly_once(log)
    assert text_of(log) == references[0]
    assert await group.attempts(running) == 1  # the writer and lease renewal carried on: no reclaim
    second_log = await group.log(queued)
    assert_exactly_once(second_log)
    assert text_of(second_log) == references[1]
    await _assert_worker_reconnected(group, running)


async def test_idle_workers_neither_crash_nor_spin_while_redis_is_down(group: Group) -> None:
    group.redis_server.stop(signal.SIGKILL)
    before = [_cpu_seconds(worker) for worker in group.workers]
    await asyncio.sleep(3)
    used = [_cpu_seconds(worker) - start for worker, start in zip(group.workers, before, strict=True)]
    group.redis_server.start()
    assert max(used) < 0.6, used  # a loop spinning on connection errors would use a core
    await wait_for(lambda: _answers(group), what="the API to reconnect")
    for model in (ONE, TIMED):
        assert_exactly_once(await group.log(await group.create(body(model, "Back", max_output_tokens=5))))


async def test_sigterm_lets_a_running_task_finish_within_the_grace_period(group: Group) -> None:
    worker = group.workers[0]
    task_id = await group.create(body(ONE, "Finish me", max_output_tokens=300))
    later: list[str] = []

    async def stop() -> None:
        worker.signal(signal.SIGTERM)
        later.append(await group.create(body(ONE, "Too late", max_output_tokens=5)))

    log = await group.follow_and_act(task_id, 40, stop)
    assert_exactly_once(log, final=wire.INCOMPLETE)
    assert worker.wait() == 0
    assert await group.attempts(task_id) == 1
    assert group.worker_with_id(str(await group.field(task_id, "worker"))) is worker
    assert "handed back" not in worker.output()
    assert await group.field(later[0], "status") == "queued"  # the stopping worker took no new job


async def _assert_partial_output_kept(group: Group, log: list[SseEvent], task: dict[str, Any]) -> None:
    """The failed response holds the message the stream delivered, cut short: in the final event,
    the task's result, the stored response and the OpenAI rendering alike."""
    [added] = [e.data["item"] for e in log if e.event == wire.ITEM_ADDED]
    assert not any(e.event == wire.ITEM_DONE for e in log)
    partial = {"type": "message", "id": added["id"], "role": "assistant",
               "content": [{"type": "output_text", "text": text_of(log)}], "status": "incomplete"}
    assert log[-1].data["output"] == [partial]
    assert task["response"]["status"] == "failed" and task["response"]["output"] == [partial]
    assert task["response"]["error"] == task["error"] == log[-1].data["error"]
    stored = (await group.http.get(f"/lmsp/v1/responses/{task['response_id']}")).json()
    assert stored == task["response"]
    openai = (await group.http.get(f"/v1/responses/{task['response_id']}")).json()
    assert openai["status"] == "failed" and [item["status"] for item in openai["output"]] == ["incomplete"]
    assert openai["output"][0]["content"][0]["text"] == text_of(log)
    # sent back as input, the cut-short item is accepted (its status ignored)
    echo = body(ONE, max_output_tokens=1) | {"input": [*body()["input"], partial]}
    assert (await group.http.post("/lmsp/v1/responses", json=echo)).status_code == 200


async def _assert_unavailable(group: Group, task_id: str) -> None:
    problem = assert_problem(await group.http.post("/lmsp/v1/tasks", json=body(ONE)), 503, "service_unavailable")
    assert problem["title"]
    for path in (f"/lmsp/v1/tasks/{task_id}", f"/lmsp/v1/tasks/{task_id}/events"):
        response = await group.http.get(path)
        assert_problem(response, 503, "service_unavailable")
        assert response.headers["retry-after"]
    assert (await group.http.get("/readyz")).status_code == 503
    assert all(worker.process is not None and worker.process.poll() is None for worker in group.workers)


async def _answers(group: Group, task_id: str | None = None) -> bool:
    path = f"/lmsp/v1/tasks/{task_id}" if task_id else "/readyz"
    return (await group.http.get(path)).status_code == 200


async def _assert_worker_reconnected(group: Group, task_id: str) -> None:
    """Polling, the wake channel and the heartbeat of the worker are back."""
    assert_exactly_once(await group.log(await group.create(body(ONE, "After", max_output_tokens=5))))
    channel = keys.wake_channel(ONE)
    await wait_for(lambda: _subscribers(group, channel), what="the wake channel subscription")
    worker_id = await group.field(task_id, "worker")
    assert worker_id is not None
    beat = await group.redis.zscore(keys.workers(), worker_id)
    await wait_for(lambda: _beat_after(group, worker_id, beat or 0), what="a heartbeat")


async def _subscribers(group: Group, channel: str) -> bool:
    [(_, count)] = await group.redis.pubsub_numsub(channel)
    return int(count) >= 1


async def _beat_after(group: Group, worker_id: str, score: float) -> bool:
    return (await group.redis.zscore(keys.workers(), worker_id) or 0) > score


def _cpu_seconds(worker: Worker) -> float:
    assert worker.process is not None
    fields = Path(f"/proc/{worker.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

