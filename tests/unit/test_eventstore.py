"""The task scripts through their one caller each (``TaskStore``, ``EventStore``), and their typed
replies: claims, cancellations, appends and the token checkpoint."""

import msgspec
import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.eventstore import Append, AppendOutcome, EventStore, Final, read_tokens
from lmsp_core.store.tasks.records import CancelOutcome, ClaimOutcome, TaskStore
from tests.unit.tasks import append, claim, claimed, deltas, lapse, new_task


async def _texts(redis: aioredis.Redis, task_id: str, response_id: str) -> list[tuple[int, str, str]]:
    return [(e.id, e.name, msgspec.json.decode(e.data).get("delta", ""))
            for e in await eventlog.read_after(redis, task_id, response_id, 0)]


async def test_an_append_stores_events_and_tokens_together(redis: aioredis.Redis, store: TaskStore,
                                                           events: EventStore, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "a")
    first = await append(events, record, "a", 1, "x\u00e9", 0, (7, 8))
    second = await append(events, record, "a", 3, "\U0001f642", 2, (2**32 - 1,))
    assert first.outcome is second.outcome is AppendOutcome.STORED and first.stored
    assert not second.cancel_requested
    assert await _texts(redis, record.id, record.response_id) == [
        (1, wire.TEXT_DELTA, "x"), (2, wire.TEXT_DELTA, "\u00e9"), (3, wire.TEXT_DELTA, "\U0001f642")]
    stored = await eventlog.read_after(redis, record.id, record.response_id, 0)
    assert [(e.name, e.data) for e in stored] == list(deltas(record, "x\u00e9\U0001f642"))  # the bytes that went in
    assert await read_tokens(redis, record.id) == (7, 8, 2**32 - 1)
    assert (await store.get(record.id)).last_event_id == 3  # type: ignore[union-attr]


async def test_a_batch_sent_again_is_recognised_and_not_stored_twice(redis: aioredis.Redis, store: TaskStore,
                                                                     events: EventStore, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "a")
    await append(events, record, "a", 1, "ab", 0, (1, 2))
    again = await append(events, record, "a", 1, "ab", 0, (1, 2))
    assert again.outcome is AppendOutcome.STORED_BEFORE and again.stored
    assert (again.stored_events, again.stored_tokens) == (2, 2)
    # an earlier batch, sent again after a later one landed, is stored too
    await append(events, record, "a", 3, "c", 2, (3,))
    assert (await append(events, record, "a", 1, "ab", 0, (1, 2))).outcome is AppendOutcome.STORED_BEFORE
    assert [text for _, _, text in await _texts(redis, record.id, record.response_id)] == ["a", "b", "c"]
    assert await read_tokens(redis, record.id) == (1, 2, 3)


async def test_a_batch_that_does_not_follow_the_log_is_refused(redis: aioredis.Redis, store: TaskStore,
                                                               events: EventStore, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "a")
    await append(events, record, "a", 1, "a", 0, (1,))
    skipping = await append(events, record, "a", 3, "c", 1, (3,))  # event 2 is missing
    assert skipping.outcome is AppendOutcome.DIVERGED and not skipping.stored
    assert (skipping.stored_events, skipping.stored_tokens) == (1, 1)
    # the same numbers but more tokens than the log holds: not this batch either
    wrong_tokens = await append(events, record, "a", 1, "a", 0, (1, 2))
    assert wrong_tokens.outcome is AppendOutcome.DIVERGED
    assert [text for _, _, text in await _texts(redis, record.id, record.response_id)] == ["a"]


async def test_a_run_that_lost_its_lease_is_fenced(redis: aioredis.Redis, store: TaskStore, events: EventStore,
                                                   model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "old")
    await append(events, record, "old", 1, "a", 0, (1,))
    await lapse(redis, record)
    taken = await claimed(store, record, "new")
    assert (taken.last_event_id, taken.attempts) == (1, 2)
    assert (await append(events, record, "old", 2, "b", 1, (2,))).outcome is AppendOutcome.FENCED
    assert (await append(events, record, "new", 2, "B", 1, (5,))).outcome is AppendOutcome.STORED
    assert [text for _, _, text in await _texts(redis, record.id, record.response_id)] == ["a", "B"]
    assert await read_tokens(redis, record.id) == (1, 5)


async def test_the_final_batch_ends_the_task_and_nothing_follows(redis: aioredis.Redis, store: TaskStore,
                                                                 settings: Settings, model: str) -> None:
    events = EventStore(redis, settings.replace(event_retention=60, task_retention=120))
    record = await new_task(store, model)
    await claimed(store, record, "a")
    usage = wire.Usage(input_tokens=1, output_tokens=1, total_tokens=2)
    done = wire.encoder.encode(wire.ResponseCompleted(response_id=record.response_id, status="completed", usage=usage))
    text = wire.OutputMessage(id="msg_1", content=[wire.OutputTextPart(text="caf\u00e9 \u2615")])
    response = wire.Response(id=record.response_id, created_at=int(record.created_at), status="completed",
                             model=model, output=[text], usage=usage)
    reply = await events.append(Append(
        task_id=record.id, response_id=record.response_id, lease="a", first_id=1,
        events=(*deltas(record, "a"), (wire.COMPLETED, done)), token_offset=0, tokens=(4,),
        final=Final("completed", wire.encoder.encode(response))))
    assert reply.outcome is AppendOutcome.STORED and not reply.cancel_requested
    final = await store.get(record.id)
    assert final is not None and final.status == "completed" and final.final
    assert final.response_object() == response and final.problem() is None
    assert not await redis.hexists(keys.task(record.id), "lease")  # type: ignore[misc]
    assert 0 < await redis.pttl(keys.events(record.id)) <= 60_000
    assert 60_000 < await redis.pttl(keys.task(record.id)) <= 120_000
    # the lease went with the end: a late batch of the same run is fenced, the log ends as it did
    assert (await append(events, record, "a", 3, "b", 1, (5,))).outcome is AppendOutcome.FENCED
    tail = await eventlog.last_event(redis, record.id, record.response_id)
    assert tail is not None and tail.id == 2 and tail.final


async def test_claims(redis: aioredis.Redis, store: TaskStore, model: str) -> None:
    record = await new_task(store, model)
    first = await claimed(store, record, "a")
    assert (first.last_event_id, first.attempts, first.cancel_requested) == (0, 1, False)
    assert (await claim(store, record, "b")).outcome is ClaimOutcome.HELD
    assert await store.cancel(record) is CancelOutcome.STOPPING
    await lapse(redis, record)
    resumed = await claimed(store, record, "b")
    assert (resumed.attempts, resumed.cancel_requested) == (2, True)
    await store.redis.delete(keys.task(record.id))
    assert (await claim(store, record, "c")).outcome is ClaimOutcome.MISSING

    cancelled = await new_task(store, model)
    assert await store.cancel(cancelled) is CancelOutcome.DEQUEUED
    assert (await claim(store, cancelled, "a")).outcome is ClaimOutcome.FINAL
    assert await store.cancel(cancelled) is CancelOutcome.FINAL
    await store.redis.delete(keys.task(cancelled.id))
    assert await store.cancel(cancelled) is CancelOutcome.MISSING


async def test_a_task_claimed_max_attempts_times_fails(redis: aioredis.Redis, settings: Settings,
                                                       model: str) -> None:
    store = TaskStore(redis, settings.replace(max_attempts=2))
    record = await new_task(store, model)
    for lease in ("a", "b"):
        await claimed(store, record, lease)
        await lapse(redis, record)
    assert (await claim(store, record, "c")).outcome is ClaimOutcome.EXHAUSTED
    failed = await store.get(record.id)
    assert failed is not None and failed.status == "failed" and failed.problem() is not None
    tail = await eventlog.last_event(redis, record.id, record.response_id)
    assert tail is not None and tail.name == wire.FAILED
    assert (await claim(store, record, "d")).outcome is ClaimOutcome.FINAL


async def test_a_cancel_request_reaches_the_running_worker_with_its_next_append(
        redis: aioredis.Redis, store: TaskStore, events: EventStore, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "a")
    assert not (await append(events, record, "a", 1, "a", 0)).cancel_requested
    assert await store.cancel(record) is CancelOutcome.STOPPING
    assert (await append(events, record, "a", 2, "b", 0)).cancel_requested
