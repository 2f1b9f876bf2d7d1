"""Resuming a task another worker left behind: the claim says where the log ends, the history
(``workers.taskrun.load_history``) gives the output items announced so far and the token checkpoint,
and the resumed run's writer continues with the next event number and token offset."""

import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.eventstore import read_tokens
from lmsp_core.store.tasks.records import TaskRecord, TaskStore
from tests.unit.tasks import Run, claimed, delta, lapse, new_task
from workers.taskrun import History, load_history
from workers.writer import EventWriter


def _added(record: TaskRecord, index: int, item: wire.OutputItem) -> wire.OutputItemAdded:
    return wire.OutputItemAdded(response_id=record.response_id, output_index=index, item=item)


async def test_a_resumed_run_continues_where_the_stored_log_ends(redis: aioredis.Redis, store: TaskStore,
                                                                 settings: Settings, model: str) -> None:
    record = await new_task(store, model)
    await claimed(store, record, "first")
    message = wire.OutputMessage(id="msg_1")
    call = wire.OutputFunctionCall(id="fc_1", call_id="call_1", name="f", arguments="{}")
    first, writer = Run(record, "first"), EventWriter(redis, settings)
    writer.open(first, 0, 0)
    writer.event(first, wire.CREATED, wire.ResponseCreated(response_id=record.response_id))
    writer.event(first, wire.ITEM_ADDED, _added(record, 0, message))
    deltas = eventlog.READ_CHUNK + 10  # the history is read in more than one chunk
    for i in range(deltas):  # a flush between two deltas: one event each
        writer.event(first, wire.TEXT_DELTA, delta(record, str(i)))
        writer.tokens(first, [i])
        await writer.flush()
    writer.event(first, wire.ITEM_ADDED, _added(record, 1, call))
    writer.tokens(first, [70_000])
    await writer.flush()
    stored = 2 + deltas + 1

    await lapse(redis, record)  # its worker died
    claim = await claimed(store, record, "second")
    assert (claim.last_event_id, claim.attempts) == (stored, 2)
    history = await load_history(redis, record.id, record.response_id, claim.last_event_id)
    assert history.last_event_id == stored
    assert history.items == [message, call]
    assert history.tokens == (*range(deltas), 70_000)

    second = Run(record, "second")
    resumed = EventWriter(redis, settings)
    resumed.open(second, history.last_event_id, len(history.tokens))
    assert resumed.event(second, wire.TEXT_DELTA, delta(record, "more")) == stored + 1
    resumed.tokens(second, [5])
    await resumed.flush()
    assert not second.fenced and not resumed.unsent(record.id)
    assert await read_tokens(redis, record.id) == (*history.tokens, 5)
    tail = await eventlog.last_event(redis, record.id, record.response_id)
    assert tail is not None and tail.id == stored + 1


async def test_a_task_that_never_started_has_no_history(redis: aioredis.Redis, store: TaskStore,
                                                        model: str) -> None:
    record = await new_task(store, model)
    claim = await claimed(store, record, "a")
    history = await load_history(redis, record.id, record.response_id, claim.last_event_id)
    assert history == History() and history.delivered.items() == []
