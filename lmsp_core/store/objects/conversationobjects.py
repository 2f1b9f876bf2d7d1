"""OpenAI's conversations (``/v1/conversations``): durable lists of items that responses continue.

A conversation is four keys of one hash tag (``keys.conversation_keys``): its record, its items in
order (a sorted set of ids scored by place), the items themselves, and its open turns. A response
created with ``conversation`` takes a turn (``reserve``): its input items are appended at once, and
the place after them is kept for its output. The output is settled into that place once the task is
final (``settle``), from the response the worker stored with the final event, by whichever process
meets the turn first: a reader of the conversation, or the consumer of ended tasks. The SETTLE
script takes the turn and writes its items in one step, so a turn is settled exactly once however
often its task's end is seen, and whichever worker wrote its final event (a killed worker's task
runs again; its final event and response are stored once). A turn holds the conversation while it
is open: a second response is ``conversation_locked`` until the first is final.

Retention is the stored responses' (``LMSP_RESPONSE_RETENTION``) from the last write, the four keys
together. Nothing here checks a client's input: that is the request layer's.
"""

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from redis.asyncio import Redis

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.connections import ReplicaWatch, replicated
from lmsp_core.store.objects.conversations import output_as_input
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest, NotFound

Order = Literal["asc", "desc"]
ITEM_PREFIXES: dict[type, str] = {wire.Message: ids.MESSAGE, wire.FunctionCall: ids.FUNCTION_CALL,
                                  wire.FunctionCallOutput: ids.FUNCTION_CALL_OUTPUT, wire.Reasoning: ids.REASONING}
_ITEMS = msgspec.json.Decoder(wire.InputItem)

# KEYS: record, order, items, turns. Items come as (id, JSON) pairs from ARGV[first]; each takes
# the place base + i * step. Returns nothing: ids are the caller's.
_PLACE = """
local function place(first, count, base, step)
  for i = 0, count - 1 do
    local id = ARGV[first + i * 2]
    redis.call('HSET', KEYS[3], id, ARGV[first + i * 2 + 1])
    redis.call('ZADD', KEYS[2], base + i * step, id)
  end
end
local function append(first, count)
  local base = redis.call('HINCRBY', KEYS[1], 'next', count) - count
  place(first, count, base, 1)
end
local function keep(ttl)
  for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
end
local function owned(owner)
  return redis.call('HGET', KEYS[1], 'owner') == owner
end
"""

# ARGV: owner, created_at, metadata, ttl, count, pairs
_CREATE = _PLACE + """
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'created_at', ARGV[2], 'metadata', ARGV[3], 'next', 0)
append(6, tonumber(ARGV[5]))
keep(tonumber(ARGV[4]))
return 1
"""

# ARGV: owner, ttl, count, pairs. 0: no such conversation of this owner
_APPEND = _PLACE + """
if not owned(ARGV[1]) then return 0 end
append(4, tonumber(ARGV[3]))
keep(tonumber(ARGV[2]))
return 1
"""

# ARGV: owner, ttl, response id, task id, count, pairs. 0: not found, -1: a turn is open
_RESERVE = _PLACE + """
if not owned(ARGV[1]) then return 0 end
if redis.call('HLEN', KEYS[4]) > 0 then return -1 end
local count = tonumber(ARGV[5])
append(6, count)
local turn = {ARGV[4], redis.call('HINCRBY', KEYS[1], 'next', 1) - 1}
for i = 0, count - 1 do turn[#turn + 1] = ARGV[6 + i * 2] end
redis.call('HSET', KEYS[4], ARGV[3], table.concat(turn, ' '))
keep(tonumber(ARGV[2]))
return 1
"""

# ARGV: response id, ttl, count, pairs. The turn's output takes its place; 0: no such turn (settled)
_SETTLE = _PLACE + """
local turn = redis.call('HGET', KEYS[4], ARGV[1])
if not turn then return 0 end
redis.call('HDEL', KEYS[4], ARGV[1])
local at = tonumber(string.match(turn, '^%S+ (%S+)'))
local count = tonumber(ARGV[3])
place(4, count, at, 1 / (count + 1))
keep(tonumber(ARGV[2]))  -- the items' keys too, where the output is all they hold
return 1
"""

# ARGV: response id. A turn whose task was never queued leaves nothing behind, its input neither
_FORGET = """
local turn = redis.call('HGET', KEYS[4], ARGV[1])
if not turn then return 0 end
redis.call('HDEL', KEYS[4], ARGV[1])
local n = 0
for id in string.gmatch(turn, '%S+') do
  n = n + 1
  if n > 2 then
    redis.call('ZREM', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
  end
end
return 1
"""

# ARGV: owner, ttl, metadata
_UPDATE = _PLACE + """
if not owned(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'metadata', ARGV[3])
keep(tonumber(ARGV[2]))
return 1
"""

# ARGV: owner, item id. 0: no conversation, -1: no such item
_DELETE_ITEM = _PLACE + """
if not owned(ARGV[1]) then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[2]) == 0 then return -1 end
redis.call('HDEL', KEYS[3], ARGV[2])
return 1
"""

# ARGV: owner
_DELETE = _PLACE + """
if not owned(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return 1
"""


class ConversationRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    owner: str
    created_at: int  # Unix seconds, as OpenAI's conversation object
    metadata: dict[str, str]


class Turn(msgspec.Struct, frozen=True):
    """An open turn: the response whose output is to come, and its task."""

    response_id: str
    task_id: str


def not_found(conversation_id: str) -> NotFound:
    return NotFound(f"Conversation {conversation_id!r} does not exist (or has expired).",
                    code="conversation_not_found")


def locked(conversation_id: str) -> InvalidRequest:
    return InvalidRequest(f"Another response of conversation {conversation_id!r} is still being generated; retry "
                          "once it is final.", code="conversation_locked", extra={"param": "conversation"})


def with_ids(items: Sequence[wire.InputItem]) -> list[wire.InputItem]:
    """The items with ids of their own in a conversation: new ones, the client's are not unique there."""
    return [msgspec.structs.replace(item, id=ids.new_id(ITEM_PREFIXES[type(item)])) for item in items]


def _pairs(items: Sequence[wire.InputItem]) -> list[Any]:
    pairs: list[Any] = []
    for item in items:
        pairs += [item.id, wire.encoder.encode(item)]
    return pairs


class ConversationObjects:
    def __init__(self, redis: Redis, settings: Settings, replicas: ReplicaWatch | None = None) -> None:
        self.redis = redis
        self.ttl_ms = int(settings.response_retention * 1000)
        self.replicas = replicas
        self._create = redis.register_script(_CREATE)
        self._append = redis.register_script(_APPEND)
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._forget = redis.register_script(_FORGET)
        self._update = redis.register_script(_UPDATE)
        self._delete_item = redis.register_script(_DELETE_ITEM)
        self._delete = redis.register_script(_DELETE)

    async def _acknowledged(self, conversation_id: str) -> None:
        """Return once the replicas hold the conversation's writes too (or the wait timed out)."""
        if self.replicas is not None:
            await replicated(self.redis, self.replicas, keys.conversation(conversation_id))

    async def _run(self, script: Any, conversation_id: str, args: list[Any]) -> int:
        return int(await script(keys=keys.conversation_keys(conversation_id), args=args))

    # --- the conversation ------------------------------------------------------------------------

    async def create(self, owner: str, created_at: int, metadata: dict[str, str],
                     items: Sequence[wire.InputItem]) -> ConversationRecord:
        record = ConversationRecord(id=ids.new_id(ids.CONVERSATION), owner=owner, created_at=created_at,
                                    metadata=metadata)
        await self._run(self._create, record.id, [owner, created_at, msgspec.json.encode(metadata), self.ttl_ms,
                                                  len(items), *_pairs(items)])
        await self._acknowledged(record.id)
        return record

    async def get(self, conversation_id: str, owner: str) -> ConversationRecord:
        """The owner's conversation; anything else is ``404 conversation_not_found``."""
        found = await self.redis.hmget(keys.conversation(conversation_id), ["owner", "created_at", "metadata"])  # type: ignore[misc]
        if found[0] is None or found[0].decode() != owner:
            raise not_found(conversation_id)
        return ConversationRecord(id=conversation_id, owner=owner, created_at=int(found[1]),
                                  metadata=msgspec.json.decode(found[2], type=dict[str, str]))

    async def update(self, conversation_id: str, owner: str, metadata: dict[str, str]) -> ConversationRecord:
        if not await self._run(self._update, conversation_id, [owner, self.ttl_ms, msgspec.json.encode(metadata)]):
            raise not_found(conversation_id)
        await self._acknowledged(conversation_id)
        return await self.get(conversation_id, owner)

    async def delete(self, conversation_id: str, owner: str) -> None:
        """Delete it and its items; a response still generating for it appends nothing."""
        if not await self._run(self._delete, conversation_id, [owner]):
            raise not_found(conversation_id)
        await self._acknowledged(conversation_id)

    # --- its items -------------------------------------------------------------------------------

    async def append(self, conversation_id: str, owner: str, items: Sequence[wire.InputItem]) -> None:
        """Append items that have their ids (``with_ids``)."""
        if not await self._run(self._append, conversation_id, [owner, self.ttl_ms, len(items), *_pairs(items)]):
            raise not_found(conversation_id)
        await self._acknowledged(conversation_id)

    async def items(self, conversation_id: str) -> list[wire.InputItem]:
        """Every item, in order (the earlier turns of a response that continues the conversation)."""
        order = await self.redis.zrange(keys.conversation_order(conversation_id), 0, -1)
        return await self._load(conversation_id, order)

    async def item(self, conversation_id: str, owner: str, item_id: str) -> wire.InputItem:
        await self.get(conversation_id, owner)
        raw = await self.redis.hget(keys.conversation_items(conversation_id), item_id)  # type: ignore[misc]
        if raw is None:
            raise item_not_found(conversation_id, item_id)
        return _ITEMS.decode(raw)

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> None:
        outcome = await self._run(self._delete_item, conversation_id, [owner, item_id])
        if outcome == 0:
            raise not_found(conversation_id)
        if outcome < 0:
            raise item_not_found(conversation_id, item_id)
        await self._acknowledged(conversation_id)

    async def page(self, conversation_id: str, *, limit: int, order: Order,
                   after: str | None) -> tuple[list[wire.InputItem], bool]:
        """Up to ``limit`` items after the item ``after`` names (from the start without it), in
        ``order``, and whether more follow."""
        key = keys.conversation_order(conversation_id)
        low: float | str = "-inf"
        if after is not None:
            score = await self.redis.zscore(key, after)
            if score is None:
                raise InvalidRequest(f"after {after!r} names no item of conversation {conversation_id!r}.",
                                     code="invalid_cursor", extra={"param": "after"})
            low = f"({score!r}"
        if order == "asc":
            chosen = await self.redis.zrangebyscore(key, low, "+inf", start=0, num=limit + 1)
        else:
            high = "+inf" if after is None else str(low)
            chosen = await self.redis.zrevrangebyscore(key, high, "-inf", start=0, num=limit + 1)
        return await self._load(conversation_id, chosen[:limit]), len(chosen) > limit

    async def _load(self, conversation_id: str, order: list[bytes]) -> list[wire.InputItem]:
        if not order:
            return []
        raw = await self.redis.hmget(keys.conversation_items(conversation_id), order)  # type: ignore[misc]
        return [_ITEMS.decode(value) for value in raw if value is not None]  # deleted meanwhile: skipped

    # --- a response's turn -----------------------------------------------------------------------

    async def reserve(self, conversation_id: str, owner: str, turn: Turn, items: Sequence[wire.InputItem]) -> None:
        """Append a response's input items and keep the place after them for its output;
        ``conversation_locked`` while another turn is open."""
        await self.redis.set(keys.task_conversation(turn.task_id), conversation_id, px=self.ttl_ms)
        outcome = await self._run(self._reserve, conversation_id, [owner, self.ttl_ms, turn.response_id,
                                                                   turn.task_id, len(items), *_pairs(items)])
        if outcome == 0:
            raise not_found(conversation_id)
        if outcome < 0:
            raise locked(conversation_id)
        await self._acknowledged(conversation_id)

    async def forget(self, conversation_id: str, turn: Turn) -> None:
        """Undo ``reserve`` for a task that was never queued."""
        await self._run(self._forget, conversation_id, [turn.response_id])
        await self.redis.delete(keys.task_conversation(turn.task_id))

    async def open_turns(self, conversation_id: str) -> list[Turn]:
        raw = await self.redis.hgetall(keys.conversation_turns(conversation_id))  # type: ignore[misc]
        return [Turn(response_id.decode(), value.decode().split(" ", 1)[0]) for response_id, value in raw.items()]

    async def settle(self, conversation_id: str) -> list[Turn]:
        """Settle every open turn whose task is final; returns the turns still open."""
        still: list[Turn] = []
        for turn in await self.open_turns(conversation_id):
            if not await self.settle_turn(conversation_id, turn):
                still.append(turn)
        return still

    async def settle_turn(self, conversation_id: str, turn: Turn) -> bool:
        """Put the output of a final task in its turn's place (once: a settled turn is gone). False:
        the task is not final yet. A task whose record is gone (it expired) settles with no output."""
        status, response = await self.redis.hmget(keys.task(turn.task_id), ["status", "response"])  # type: ignore[misc]
        if status is not None and status.decode() not in wire.FINAL_STATUSES:
            return False
        output: list[wire.InputItem] = []
        if response:
            output = [output_as_input(item) for item in msgspec.json.decode(response, type=wire.Response).output]
        await self._run(self._settle, conversation_id, [turn.response_id, self.ttl_ms, len(output), *_pairs(output)])
        return True

    async def settle_task(self, task_id: str) -> bool:
        """Settle the turn of an ended task, if it has one (the consumer of ended tasks)."""
        conversation_id = await self.redis.get(keys.task_conversation(task_id))
        if conversation_id is None:
            return False
        conversation_id = conversation_id.decode()
        for turn in await self.open_turns(conversation_id):
            if turn.task_id == task_id:
                return await self.settle_turn(conversation_id, turn)
        return False


def item_not_found(conversation_id: str, item_id: str) -> NotFound:
    return NotFound(f"Item {item_id!r} does not exist in conversation {conversation_id!r}.", code="item_not_found")
