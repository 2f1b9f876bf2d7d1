"""OpenAI's conversation objects (``lmsp_core.store.objects.conversationobjects``) against the real
redis-server: owners, order and cursors, and a response's turn: reserved with its input, settled once
with the final response's output in its place, or forgotten."""

import uuid

import msgspec
import pytest
import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.objects.conversationobjects import ConversationObjects, Turn, with_ids
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest, NotFound


@pytest.fixture
def objects(redis: aioredis.Redis, settings: Settings) -> ConversationObjects:
    return ConversationObjects(redis, msgspec.structs.replace(settings, response_retention=3600.0))


def owner() -> str:
    return f"p-{uuid.uuid4().hex[:12]}"


def said(*texts: str) -> list[wire.InputItem]:
    return with_ids([wire.Message(role="user", content=[wire.InputText(text=text)]) for text in texts])


def text(item: wire.InputItem) -> str:
    assert isinstance(item, wire.Message)
    return "".join(part.text for part in item.content if isinstance(part, wire.TEXT_PARTS))


async def final_task(redis: aioredis.Redis, task_id: str, *answers: str) -> list[str]:
    """A task record as the worker leaves it at the final event; returns its output items' ids."""
    output = [wire.OutputMessage(id=ids.new_id(ids.MESSAGE), content=[wire.OutputText(text=answer)])
              for answer in answers]
    response = wire.Response(id=ids.new_id(ids.RESPONSE), created_at=0, status="completed", model="m",
                             output=list(output), usage=None)
    await redis.hset(keys.task(task_id), mapping={"status": "completed",
                                                  "response": wire.encoder.encode(response)})
    return [item.id for item in output]


async def test_items_keep_their_order_and_their_owner(objects: ConversationObjects, redis: aioredis.Redis) -> None:
    record = await objects.create(who := owner(), 1, {"a": "b"}, said("one", "two"))
    await objects.append(record.id, who, said("three"))
    assert [text(item) for item in await objects.items(record.id)] == ["one", "two", "three"]
    first, more = await objects.page(record.id, limit=2, order="asc", after=None)
    rest, no_more = await objects.page(record.id, limit=2, order="asc", after=first[-1].id)
    assert [text(item) for item in first + rest] == ["one", "two", "three"] and more and not no_more
    back, _ = await objects.page(record.id, limit=5, order="desc", after=rest[0].id)
    assert [text(item) for item in back] == ["two", "one"]
    for key in keys.conversation_keys(record.id)[:3]:
        assert 3590_000 < await redis.pttl(key) <= 3600_000, key
    with pytest.raises(NotFound):
        await objects.get(record.id, owner())
    with pytest.raises(NotFound):
        await objects.append(record.id, owner(), said("theirs"))
    with pytest.raises(InvalidRequest):
        await objects.page(record.id, limit=5, order="asc", after="msg_unknown")
    assert len(await objects.items(record.id)) == 3


async def test_a_turn_is_settled_once_in_its_place(objects: ConversationObjects, redis: aioredis.Redis) -> None:
    record = await objects.create(who := owner(), 1, {}, said("before"))
    turn = Turn(ids.new_id(ids.RESPONSE), ids.new_id(ids.TASK))
    await redis.hset(keys.task(turn.task_id), "status", "in_progress")
    await objects.reserve(record.id, who, turn, said("question"))
    with pytest.raises(InvalidRequest) as locked:  # one open turn at a time
        await objects.reserve(record.id, who, Turn(ids.new_id(ids.RESPONSE), ids.new_id(ids.TASK)), said("no"))
    assert locked.value.code == "conversation_locked"
    await objects.append(record.id, who, said("meanwhile"))
    assert await objects.settle(record.id) == [turn]  # not final: still open
    answer_ids = await final_task(redis, turn.task_id, "answer", "more")
    assert await objects.settle_task(turn.task_id)
    assert not await objects.settle_task(turn.task_id)  # settled: the second end changes nothing
    await objects.settle_turn(record.id, turn)  # nor does a reader that met the open turn before
    assert await objects.settle(record.id) == []
    items = await objects.items(record.id)
    assert [text(item) for item in items] == ["before", "question", "answer", "more", "meanwhile"]
    assert [item.id for item in items[2:4]] == answer_ids
    for key in keys.conversation_keys(record.id)[:3]:
        assert await redis.pttl(key) > 0, key


async def test_a_turn_never_queued_is_forgotten(objects: ConversationObjects, redis: aioredis.Redis) -> None:
    record = await objects.create(who := owner(), 1, {}, said("before"))
    turn = Turn(ids.new_id(ids.RESPONSE), ids.new_id(ids.TASK))
    await objects.reserve(record.id, who, turn, said("question"))
    await objects.forget(record.id, turn)
    assert [text(item) for item in await objects.items(record.id)] == ["before"]
    assert await objects.open_turns(record.id) == [] and not await redis.exists(keys.task_conversation(turn.task_id))
    await objects.delete(record.id, who)
    with pytest.raises(NotFound):
        await objects.delete(record.id, who)
