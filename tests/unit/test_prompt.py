"""A request is checked and its prompt rendered once, by the API when it accepts it: the task record
carries the prompt's token ids and the digest of the model card they were rendered with, and a
worker uses them only if its own card is that one (else it renders and checks the prompt itself)."""

import msgspec

from lmsp_core import wire
from lmsp_core.store.tasks.eventstore import pack_tokens
from lmsp_core.store.tasks.records import TaskRecord, TaskStore
from lmsp_core.wire import ids
from tests.unit.tasks import new_task


async def test_the_rendered_prompt_travels_with_the_task(store: TaskStore, model: str) -> None:
    plain = await new_task(store, model)
    rendered = msgspec.structs.replace(plain, id=ids.new_id(ids.TASK), prompt=pack_tokens([1, 70000, 2]),
                                       prompt_card="card-a")
    await store.create(rendered)
    stored = await store.get(rendered.id)
    assert stored is not None
    assert stored.prompt_ids("card-a") == [1, 70000, 2]
    assert stored.prompt_ids("card-b") is None  # another card: the worker renders it again
    unrendered = await store.get(plain.id)
    assert unrendered is not None and unrendered.prompt_ids("card-a") is None


def test_records_without_a_prompt_decode_as_before() -> None:
    record = TaskRecord(id="t", model="m", owner="o", kind="task", status="queued", created_at=0.0,
                        response_id="r", request=wire.encoder.encode({"model": "m", "input": "hi"}))
    assert record.prompt is None and record.prompt_ids("any") is None
