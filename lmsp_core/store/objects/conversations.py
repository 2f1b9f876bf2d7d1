"""Stored responses (``store: true``) and conversations (``previous_response_id``).

A stored response keeps the input items of its own turn, its previous response's id and, once
final, the response object (written by the worker in the same atomic step as the final event).
Continuing a conversation walks the chain of stored turns back to its start and rebuilds the
context from each turn's input and output items, so the HTTP connection never holds conversation
state (6.1). Each continuation extends the retention of the whole chain.
"""

from collections.abc import Sequence
from typing import Any

import msgspec
from redis.asyncio import Redis

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire.errors import InvalidRequest, NotFound
from lmsp_core.wire.extensions import parse as parse_extensions

MAX_TURNS = 1000


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    response_id: str
    task_id: str
    owner: str
    model: str
    created_at: float
    input: list[wire.InputItem]  # this turn's own input items
    previous_response_id: str | None = None
    response: wire.Response | None = None  # None until the response is final
    # the request's extensions: what the response object echoes once the task's record has expired
    extensions: dict[str, Any] | None = None

    def as_response(self) -> wire.Response:
        """The stored response, or an in-progress response object while it is being generated."""
        if self.response is not None:
            return self.response
        metadata = parse_extensions(self.extensions).metadata
        return wire.Response(id=self.response_id, created_at=int(self.created_at), status="in_progress",
                             model=self.model, output=[], usage=None,
                             metadata=msgspec.UNSET if metadata is None else metadata)


def output_as_input(item: wire.OutputItem) -> wire.InputItem:
    """An output item as the input item that carries it into the next turn."""
    if isinstance(item, wire.OutputMessage):
        return wire.Message(role="assistant", content=[wire.OutputText(text=part.text) for part in item.content],
                            id=item.id)
    if isinstance(item, wire.OutputFunctionCall):
        return wire.FunctionCall(call_id=item.call_id, name=item.name, arguments=item.arguments, id=item.id)
    return wire.Reasoning(summary=[wire.SummaryText(text=part.text) for part in item.summary], id=item.id)


def context(chain: Sequence[StoredResponse], new_input: Sequence[wire.InputItem]) -> list[wire.InputItem]:
    """The whole input of a continuation: every earlier turn's input and output, then the new input."""
    items: list[wire.InputItem] = []
    for turn in chain:
        items += turn.input
        if turn.response is not None:
            items += [output_as_input(item) for item in turn.response.output]
    return items + list(new_input)


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response {response_id!r} does not exist (or was not stored, or has expired).",
                    code="response_not_found")


class ConversationStore:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.ttl_ms = int(settings.response_retention * 1000)

    async def load(self, response_id: str, owner: str) -> StoredResponse:
        """A stored response of this owner; anything else is ``404 response_not_found``."""
        task_id = await self.redis.get(keys.response(response_id))
        raw = await self.redis.hgetall(keys.stored(task_id.decode())) if task_id else {}  # type: ignore[misc]
        if not raw or raw.get(b"owner", b"").decode() != owner:
            raise _not_found(response_id)
        fields = {key.decode(): value for key, value in raw.items()}
        return StoredResponse(
            response_id=response_id, task_id=fields["task_id"].decode(), owner=owner,
            model=fields["model"].decode(), created_at=float(fields["created_at"]),
            input=msgspec.json.decode(fields["input"], type=list[wire.InputItem]),
            previous_response_id=fields["previous"].decode() if "previous" in fields else None,
            response=msgspec.json.decode(fields["response"], type=wire.Response) if "response" in fields else None,
            extensions=msgspec.json.decode(fields["extensions"]) if "extensions" in fields else None,
        )

    async def chain(self, response_id: str, owner: str) -> list[StoredResponse]:
        """The conversation that ends with ``response_id``, oldest turn first."""
        turns: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None:
            if len(turns) >= MAX_TURNS or any(turn.response_id == next_id for turn in turns):
                raise InvalidRequest(f"The conversation of {response_id!r} is longer than {MAX_TURNS} turns.",
                                     code="conversation_too_long")
            turn = await self.load(next_id, owner)
            if turn.response is None:
                raise InvalidRequest(f"Response {next_id!r} is still being generated; continue it once it is "
                                     "final.", code="previous_response_in_progress")
            turns.append(turn)
            next_id = turn.previous_response_id
        return turns[::-1]

    async def store(self, record: TaskRecord, request: wire.ResponseRequest, chain: Sequence[StoredResponse]) -> None:
        """Keep this turn (its response arrives with the final event) and extend the chain's life."""
        mapping: dict[str, str | bytes | float] = {
            "task_id": record.id, "owner": record.owner, "model": record.model, "created_at": record.created_at,
            "input": msgspec.json.encode(request.input),
        }
        if request.previous_response_id is not None:
            mapping["previous"] = request.previous_response_id
        if request.extensions:
            mapping["extensions"] = msgspec.json.encode(request.extensions)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.stored(record.id), mapping=mapping)
            pipe.pexpire(keys.stored(record.id), self.ttl_ms)
            pipe.set(keys.response(record.response_id), record.id, px=self.ttl_ms)
            for turn in chain:
                pipe.pexpire(keys.stored(turn.task_id), self.ttl_ms)
                pipe.pexpire(keys.response(turn.response_id), self.ttl_ms)
            await pipe.execute()

    async def forget(self, record: TaskRecord) -> None:
        """Drop a turn whose task was never queued."""
        await self.redis.delete(keys.stored(record.id), keys.response(record.response_id))

    async def delete(self, turn: StoredResponse) -> None:
        """Delete a stored turn: it can no longer be read or continued (nor a conversation through it).
        A task still running writes no response back: the final step writes only into a turn that exists."""
        await self.redis.delete(keys.stored(turn.task_id), keys.response(turn.response_id))
