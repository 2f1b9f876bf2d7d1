"""The worker's event writer against a real Redis: how it reads the append script's replies (a run
fenced off, a batch stored before its answer was lost, a cancelled or ended task), a Redis that lost
its scripts, and a log closed while its run still adds to it."""

import asyncio

import msgspec
import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.eventstore import Final, read_tokens
from lmsp_core.store.tasks.records import CancelOutcome, TaskRecord, TaskStore
from tests.unit.tasks import Run, claimed, delta, lapse, new_task
from workers.writer import EventWriter


async def _texts(redis: aioredis.Redis, record: TaskRecord) -> list[tuple[int, str]]:
    return [(e.id, msgspec.json.decode(e.data).get("delta", e.name))
            for e in await eventlog.read_after(redis, record.id, record.response_id, 0)]


def _write(writer: EventWriter, run: Run, record: TaskRecord, texts: str, tokens: list[int]) -> None:
    for text in texts:
        writer.event(run, wire.TEXT_DELTA, delta(record, text))
    writer.tokens(run, tokens)


def _finish(writer: EventWriter, run: Run, record: TaskRecord) -> None:
    cancelled = wire.ResponseCancelled(response_id=record.response_id, status="cancelled")
    writer.event(run, wire.CANCELLED, cancelled)
    writer.finalize(run, Final("cancelled", b"{}"))


async def test_appends_survive_a_redis_that_lost_its_scripts(redis: aioredis.Redis, store: TaskStore,
                                                             settings: Settings, model: str) -> None:
    writer = EventWriter(redis, settings)
    record = await new_task(store, model)
    await claimed(store, record, "a")
    run = Run(record, "a")
    writer.open(run, 0, 0)
    flushing = asyncio.create_task(writer.run())
    try:
        _write(writer, run, record, "ab", [1, 2])
        await asyncio.wait_for(writer.settled(run.task_id), 10)
        await redis.script_flush()
        _write(writer, run, record, "c", [3])
        await asyncio.wait_for(writer.settled(run.task_id), 10)
        assert await _texts(redis, record) == [(1, "ab"), (2, "c")]  # a batch's deltas of one item: one event
        assert await read_tokens(redis, record.id) == (1, 2, 3)
        assert not run.fenced
    finally:
        flushing.cancel()


async def test_a_flush_that_meets_a_redis_without_its_script_stores_before_it_returns(
        redis: aioredis.Redis, store: TaskStore, settings: Settings, model: str) -> None:
    """Each flush's batch is stored when the flush returns, also the first after the scripts went: it
    does not wait there to join the next delta."""
    writer = EventWriter(redis, settings)
    record = await new_task(store, model)
    await claimed(store, record, "a")
    run = Run(record, "a")
    writer.open(run, 0, 0)
    for index, text in enumerate("abc"):
        if index == 1:
            await redis.script_flush()
        _write(writer, run, record, text, [index])
        await writer.flush()
        assert not writer.unsent(record.id)
    assert await _texts(redis, record) == [(1, "a"), (2, "b"), (3, "c")]
    assert await read_tokens(redis, record.id) == (0, 1, 2)


async def test_a_closed_log_drops_what_its_run_adds_later(redis: aioredis.Redis, store: TaskStore,
                                                          settings: Settings, model: str) -> None:
    """A fenced run's engine step that was under way still delivers tokens after the writer closed
    the run's log; they go nowhere, also when the task runs here again (resumed) meanwhile."""
    writer = EventWriter(redis, settings)
    record = await new_task(store, model)
    await claimed(store, record, "a")
    fenced, resumed = Run(record, "a"), Run(record, "a")
    writer.open(fenced, 0, 0)
    writer.event(fenced, wire.TEXT_DELTA, delta(record, "lost"))
    writer.close(record.id)
    assert writer.event(fenced, wire.TEXT_DELTA, delta(record, "late")) is None
    writer.tokens(fenced, [9])
    writer.finalize(fenced, Final("completed", b"{}"))
    writer.open(resumed, 0, 0)
    writer.tokens(fenced, [9])
    assert writer.event(resumed, wire.TEXT_DELTA, delta(record, "kept")) == 1
    writer.tokens(resumed, [2])
    await writer.flush()
    assert await _texts(redis, record) == [(1, "kept")]
    assert await read_tokens(redis, record.id) == (2,)
    assert not writer.unsent(record.id)


async def test_a_run_whose_task_was_taken_over_is_fenced(redis: aioredis.Redis, store: TaskStore,
                                                         settings: Settings, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "old")
    old, new = Run(record, "old"), Run(record, "new")
    old_writer, new_writer = EventWriter(redis, settings), EventWriter(redis, settings)
    old_writer.open(old, 0, 0)
    _write(old_writer, old, record, "a", [1])
    await old_writer.flush()
    await lapse(redis, record)  # the old worker looked dead: the new one claims and resumes the task
    await claimed(store, record, "new")
    new_writer.open(new, 1, 1)
    _write(old_writer, old, record, "b", [2])  # numbered where the log ends, but under a lapsed lease
    await old_writer.flush()
    assert old.fenced
    assert not old_writer.unsent(record.id)  # what the fenced run adds later goes nowhere
    assert old_writer.event(old, wire.TEXT_DELTA, delta(record, "c")) is None
    _write(new_writer, new, record, "BC", [5, 6])
    await new_writer.flush()
    assert not new.fenced
    assert await _texts(redis, record) == [(1, "a"), (2, "BC")]
    assert await read_tokens(redis, record.id) == (1, 5, 6)


async def test_a_log_cut_short_under_the_run_fences_it(redis: aioredis.Redis, store: TaskStore,
                                                       settings: Settings, model: str) -> None:
    """Redis lost stored events (a crash under appendfsync everysec, a failover): the run's next batch
    does not follow the stored log; the run stops, and the task resumes from what is stored."""
    record = await new_task(store, model)
    await claimed(store, record, "a")
    run, writer = Run(record, "a"), EventWriter(redis, settings)
    writer.open(run, 0, 0)
    _write(writer, run, record, "ab", [1, 2])
    await writer.flush()
    await redis.hset(keys.task(record.id), "last_event_id", 0)  # type: ignore[misc]
    _write(writer, run, record, "c", [3])
    await writer.flush()
    assert run.fenced and not writer.unsent(record.id)
    assert await read_tokens(redis, record.id) == (1, 2)


async def test_a_batch_stored_before_its_answer_was_lost_counts_as_stored(
        redis: aioredis.Redis, store: TaskStore, settings: Settings, model: str) -> None:
    """A writer that sends a batch again (its first answer was lost) finds it stored: neither
    written twice nor taken for a lost lease, and a final batch still ends the run."""
    record = await new_task(store, model)
    await claimed(store, record, "a")
    run = Run(record, "a")
    landed, again = EventWriter(redis, settings), EventWriter(redis, settings)
    for writer in (landed, again):  # the same batches from the same run: once landed, once again
        writer.open(run, 0, 0)
        _write(writer, run, record, "ab", [1, 2])
        await writer.flush()
    assert not run.fenced and not again.unsent(record.id)
    for writer in (landed, again):
        writer.open(run, 1, 2)
        _write(writer, run, record, "c", [3])
        _finish(writer, run, record)
        await writer.flush()
        assert run.durable and not run.fenced and not writer.unsent(record.id)
        run.durable = False
    assert await _texts(redis, record) == [(1, "ab"), (2, "c"), (3, wire.CANCELLED)]
    assert await read_tokens(redis, record.id) == (1, 2, 3)
    final = await store.get(record.id)
    assert final is not None and final.status == "cancelled"


async def test_a_cancel_request_reaches_the_run_and_an_ended_task_fences_it(
        redis: aioredis.Redis, store: TaskStore, settings: Settings, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "a")
    run, writer = Run(record, "a"), EventWriter(redis, settings)
    writer.open(run, 0, 0)
    _write(writer, run, record, "a", [1])
    await writer.flush()
    assert not run.cancel_requested
    assert await store.cancel(record) is CancelOutcome.STOPPING
    _write(writer, run, record, "b", [2])
    await writer.flush()
    assert run.cancel_requested and not run.fenced
    _finish(writer, run, record)
    await writer.flush()
    assert run.durable
    # a second run of the same task on this worker, under the same lease, after the end: refused
    late = Run(record, "a")
    writer.open(late, 3, 2)
    _write(writer, late, record, "x", [9])
    await writer.flush()
    assert late.fenced and not late.durable
    tail = await eventlog.last_event(redis, record.id, record.response_id)
    assert tail is not None and tail.id == 3 and tail.final


async def test_deltas_of_one_item_in_one_batch_are_one_event(redis: aioredis.Redis, store: TaskStore,
                                                              settings: Settings, model: str) -> None:
    """A delta joins the unsent delta right before it when both are of the same kind and item; a sent
    batch, another item or another event in between starts a new event."""
    record = await new_task(store, model)
    await claimed(store, record, "a")
    run, writer = Run(record, "a"), EventWriter(redis, settings)
    writer.open(run, 0, 0)
    assert [writer.event(run, wire.TEXT_DELTA, delta(record, text)) for text in "abc"] == [1, 1, 1]
    await writer.flush()
    assert writer.event(run, wire.TEXT_DELTA, delta(record, "d")) == 2  # the batch before was sent
    other = wire.OutputTextDelta(response_id=record.response_id, item_id="msg_2", delta="x")
    assert writer.event(run, wire.TEXT_DELTA, other) == 3
    assert writer.event(run, wire.TEXT_DELTA, delta(record, "e")) == 4
    summary = wire.ReasoningSummaryTextDelta(response_id=record.response_id, item_id="msg_1", delta="r")
    assert writer.event(run, wire.REASONING_DELTA, summary) == 5  # another kind of delta
    assert writer.event(run, wire.REASONING_DELTA, summary) == 5
    writer.tokens(run, [1, 2, 3, 4, 5])
    await writer.flush()
    assert await _texts(redis, record) == [(1, "abc"), (2, "d"), (3, "x"), (4, "e"), (5, "rr")]
    assert await read_tokens(redis, record.id) == (1, 2, 3, 4, 5)


async def test_flushes_wait_for_the_interval_but_a_first_output_does_not(
        redis: aioredis.Redis, store: TaskStore, settings: Settings, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "a")
    run = Run(record, "a")
    writer = EventWriter(redis, msgspec.structs.replace(settings, event_flush_interval=1.0))
    writer.open(run, 0, 0)
    flushing = asyncio.create_task(writer.run())
    try:
        writer.event(run, wire.TEXT_DELTA, delta(record, "a"), urgent=True)  # a first token: at once
        await asyncio.wait_for(writer.settled(run.task_id), 0.5)
        writer.event(run, wire.TEXT_DELTA, delta(record, "b"))
        await asyncio.sleep(0.2)
        writer.event(run, wire.TEXT_DELTA, delta(record, "c"))  # within the interval: one event with b
        assert writer.unsent(run.task_id)
        await asyncio.wait_for(writer.settled(run.task_id), 5)
        assert await _texts(redis, record) == [(1, "a"), (2, "bc")]
    finally:
        flushing.cancel()
