"""The Python client against the real service: typed results, typed errors, and task event streams
that resume by themselves when a proxy cuts their connections mid-stream."""

import asyncio

import pytest
import redis.asyncio as aioredis

from lmsp.client import (
    AsyncClient,
    BadRequestError,
    Client,
    Event,
    NotFoundError,
    ServiceUnavailableError,
)
from lmsp.client.common import Config
from lmsp_core import wire
from lmsp_core.store import keys
from tests.proxy import CuttingProxy
from tests.support import Api, Worker, final_status


def output_text(task: wire.Task) -> str:
    assert task.response is not None
    item = task.response.output[0]
    assert isinstance(item, wire.OutputMessage)
    return item.content[0].text


def assert_log(events: list[Event]) -> None:
    logged = [event.id for event in events if event.id is not None]
    assert logged == list(range(1, len(logged) + 1)), logged  # each event once, in order
    assert events[-1].final


def test_sync_events_resume_across_cut_connections(api: Api, eager_worker: Worker) -> None:
    with CuttingProxy(api.port, cut_after=8000) as proxy, Client(proxy.url) as client:
        task = client.tasks.create(model="tiny-eager", input="Tell me a long story.", max_output_tokens=300)
        follow = client.tasks.events(task.id)
        events = list(follow)
        assert proxy.cuts >= 3 and follow.reconnects.total >= 3, proxy.cuts
    assert_log(events)
    with Client(api.url) as direct:
        final = direct.tasks.get(task.id)
    assert final.status == "incomplete"
    assert follow.text == output_text(final) and follow.last_event_id == events[-1].id
    assert isinstance(events[-1].data, wire.ResponseIncomplete)


async def test_async_events_resume_across_cut_connections(api: Api, eager_worker: Worker) -> None:
    with CuttingProxy(api.port, cut_after=6000) as proxy:
        async with AsyncClient(proxy.url) as client:
            task = await client.tasks.create(model="tiny-eager", input="Once upon a time", max_output_tokens=200)
            follow = client.tasks.events(task.id)
            events = [event async for event in follow]
            final = await client.tasks.get(task.id)
        assert proxy.cuts >= 2, proxy.cuts
    assert_log(events)
    assert follow.text == output_text(final)


async def test_resume_from_a_cursor_and_queue_notices_do_not_move_it(api: Api, tiny_worker: Worker) -> None:
    async with AsyncClient(api.url) as client:
        queued = await client.tasks.create(model="tiny-unserved", input="Hello")
        follow = client.tasks.events(queued.id, queue_events=True)
        seen: list[Event] = []
        async for event in follow:
            seen.append(event)
            if event.name == wire.QUEUED:
                assert event.id is None and follow.last_event_id == 0
                assert isinstance(event.data, wire.TaskQueued) and event.data.queue_position
                await client.tasks.cancel(queued.id)
        assert [(e.id, e.name) for e in seen if e.id] == [(1, wire.CANCELLED)]

        # not asked for, the queue position comes as comments: only the log's events, each with its id
        waiting = await client.tasks.create(model="tiny-unserved", input="Hello")

        async def cancel_later() -> None:
            await asyncio.sleep(2.5)  # past two keep-alives (1 s), each followed by the position
            await client.tasks.cancel(waiting.id)

        canceller = asyncio.create_task(cancel_later())
        plain = [(e.id, e.name) async for e in client.tasks.events(waiting.id)]
        await canceller
        assert plain == [(1, wire.CANCELLED)]

        task = await client.tasks.create(model="tiny-random", input="Hello", max_output_tokens=20)
        full = [event async for event in client.tasks.events(task.id) if event.id is not None]
        rest = [event async for event in client.tasks.events(task.id, after=4)]
        assert rest == full[4:] and rest[0].id == 5


async def test_expired_history_falls_back_to_the_final_result(api: Api, tiny_worker: Worker,
                                                              redis: aioredis.Redis) -> None:
    async with AsyncClient(api.url) as client:
        task = await client.tasks.create(model="tiny-random", input="Hello", max_output_tokens=8)
        first = [event async for event in client.tasks.events(task.id)]
        await redis.delete(keys.events(task.id))  # what retention does after LMSP_EVENT_RETENTION
        follow = client.tasks.events(task.id, after=2)
        assert [event async for event in follow] == []
        assert follow.expired and follow.task is not None and follow.task.status == "incomplete"
        assert output_text(follow.task) == "".join(event.delta for event in first)


async def test_leaving_a_stream_early_hangs_up_at_once(api: Api, tiny_worker: Worker, redis: aioredis.Redis) -> None:
    """The iterator is still referenced, so only leaving ``async with`` can close the connection;
    the service then cancels the direct stream's task (6.3)."""
    async with AsyncClient(api.url) as client:
        async with client.responses.stream(model="tiny-random", input="Tell me a long story.",
                                           max_output_tokens=1000) as stream:
            events = aiter(stream)
            created = await anext(events)
        assert isinstance(created.data, wire.ResponseCreated)
        task = await final_status(redis, created.data.response_id)
        assert task[b"status"] == b"cancelled"
        with pytest.raises(StopAsyncIteration):  # closed by ``async with``, though still referenced
            await anext(events)
    with Client(api.url) as blocking:
        with blocking.responses.stream(model="tiny-random", input="Hi", max_output_tokens=1000) as sync_stream:
            sync_events = iter(sync_stream)
            first = next(sync_events)
        assert isinstance(first.data, wire.ResponseCreated)
        with pytest.raises(StopIteration):  # closed by ``with``, though still referenced
            next(sync_events)


def test_sync_responses_and_typed_errors(api: Api, tiny_worker: Worker) -> None:
    with Client(api.url) as client:
        response = client.responses.create(model="tiny-random", input="Hi", max_output_tokens=5)
        assert isinstance(response, wire.Response) and response.usage and response.usage.output_tokens == 5
        stream = client.responses.stream(model="tiny-random", input="Hi", max_output_tokens=5)
        events = list(stream)
        assert stream.final is events[-1] and isinstance(stream.final.data, wire.ResponseIncomplete)
        assert stream.text == response.output[0].content[0].text  # type: ignore[union-attr]  # greedy
        assert [m.id for m in client.models.list().data] >= ["smollm2:135m-instruct", "tiny-random"]

        with pytest.raises(NotFoundError) as missing:
            client.tasks.get("task_01J8M6Q4W2T7N5R3V9X1Z8B0DF")
        assert missing.value.code == "task_not_found" and missing.value.status == 404
        with pytest.raises(NotFoundError) as model:
            client.responses.create(model="no-such-model", input="Hi")
        assert model.value.code == "model_not_found"
        with pytest.raises(ServiceUnavailableError) as unserved:
            client.responses.create(model="tiny-unserved", input="Hi")
        assert unserved.value.code == "model_unavailable" and unserved.value.retry_after
        with pytest.raises(BadRequestError) as big:
            client.responses.create(model="tiny-random", input="Hi", max_output_tokens=10_000)
        assert big.value.code == "max_output_tokens_too_large"
        with pytest.raises(ValueError):  # refused before sending
            client.responses.create(model="tiny-random", input="Hi", temperature=5.0)


async def test_listing_pages_through_the_callers_tasks(api: Api, tiny_worker: Worker,
                                                       redis: aioredis.Redis) -> None:
    async with AsyncClient(api.url) as client:
        mine = [(await client.tasks.create(model="tiny-unserved", input=f"task {i}")).id for i in range(5)]
        await redis.delete(keys.task(mine[2]))  # as if it had expired
        seen: list[str] = []
        cursor = None
        while True:
            page = await client.tasks.list(limit=2, cursor=cursor)
            assert len(page.data) <= 2
            seen += [task.id for task in page.data]
            if not page.has_more:
                break
            cursor = page.next_cursor
        listed = [task_id for task_id in seen if task_id in mine]
        assert listed == [mine[4], mine[3], mine[1], mine[0]]  # newest first, the expired one gone
        assert len(seen) == len(set(seen))
        assert await redis.zscore(keys.owner_tasks("local"), mine[2]) is None
        with pytest.raises(BadRequestError) as bad:
            await client.tasks.list(cursor="nonsense")
        assert bad.value.code == "invalid_cursor"
        for task_id in mine:
            if task_id != mine[2]:
                await client.tasks.cancel(task_id)


def test_token_and_url_come_from_arguments_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMSP_TOKEN", "from-env")
    monkeypatch.setenv("LMSP_URL", "http://example.invalid:9/")
    config = Config.create(None, None)
    assert config.url == "http://example.invalid:9" and config.headers["Authorization"] == "Bearer from-env"
    assert Config.create("http://h:1", "tok").headers["Authorization"] == "Bearer tok"
    monkeypatch.delenv("LMSP_TOKEN")
    monkeypatch.delenv("LMSP_URL")
    assert "Authorization" not in Config.create(None, None).headers
    assert Config.create(None, None).url == "http://127.0.0.1:8000"


async def test_concurrent_followers_through_a_cutting_proxy(api: Api, eager_worker: Worker) -> None:
    # more than the largest event (the message's whole text in output_item.done), or a reader whose
    # connection is cut inside it again and again never gets past it
    with CuttingProxy(api.port, cut_after=3000) as proxy:
        async with AsyncClient(proxy.url) as client:
            task = await client.tasks.create(model="tiny-eager", input="Many readers", max_output_tokens=150)

            async def read() -> list[Event]:
                return [event async for event in client.tasks.events(task.id)]

            logs = await asyncio.gather(*(read() for _ in range(5)))
    for log in logs:
        assert_log(log)
    # queue notices depend on when each reader connected; the task's own events do not
    first = [event for event in logs[0] if event.id is not None]
    assert all([event for event in log if event.id is not None] == first for log in logs)
