"""OpenAI's Conversations API on ``lmsp_core.store.objects.conversationobjects``: its bodies and objects,
items in and out, and a response's turn (``ConversationTurn``: where ``POST /v1/responses`` with
``conversation`` finds its earlier turns and keeps its own).

Items are kept as LMSP input items, each with an id of the conversation's (a response's output items
keep theirs), and read back in the shapes ``GET /v1/responses/{id}/input_items`` gives
(``api.openai.inputitems``). ``include`` can name nothing: there is nothing to include.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from api.openai import objects as oa
from api.openai import requests as rq
from api.openai.inputitems import item_object
from api.openai.translation import echo_of, input_items, with_client_options
from lmsp_core import wire
from lmsp_core.store.objects.conversationobjects import (
    ConversationObjects,
    ConversationRecord,
    Turn,
    locked,
    not_found,
    with_ids,
)
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest

MAX_ITEMS = 20  # OpenAI's: items a create or an append may add at once
MAX_PAGE = 100

Items = Annotated[list[dict[str, Any]], Meta(max_length=MAX_ITEMS)]


class _Body(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ConversationCreate(_Body, frozen=True, kw_only=True):
    """Body of ``POST /v1/conversations``."""

    items: Items | None = None
    metadata: rq.Metadata | None = None


class ConversationUpdate(_Body, frozen=True, kw_only=True):
    """Body of ``POST /v1/conversations/{id}``: the new metadata, all of it (null: none)."""

    metadata: rq.Metadata | None


class ItemsCreate(_Body, frozen=True, kw_only=True):
    """Body of ``POST /v1/conversations/{id}/items``."""

    items: Items


class Conversation(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True


def conversation_object(record: ConversationRecord) -> Conversation:
    return Conversation(id=record.id, created_at=record.created_at, metadata=record.metadata)


def metadata(value: dict[str, Any] | None) -> dict[str, str]:
    """Metadata checked as a response's (OpenAI's limits and codes)."""
    with_client_options(None, rq.ClientOptions(metadata=value))
    return dict(value or {})


def new_items(raw: list[dict[str, Any]] | None, *, required: bool = False) -> list[wire.InputItem]:
    """Items a client adds, translated as a response's input and given ids of the conversation;
    none only where they are not ``required``."""
    if not raw and not required:
        return []
    return with_ids(input_items(raw or [], "items"))


def item(value: wire.InputItem) -> oa.InputItem:
    """A conversation's item (it has its id) in OpenAI's shape."""
    return item_object(value, value.id or "")


def item_list(items: list[wire.InputItem], has_more: bool = False) -> oa.InputItemList:
    data = [item(value) for value in items]
    return oa.InputItemList(data=data, first_id=data[0].id if data else None,
                            last_id=data[-1].id if data else None, has_more=has_more)


def check_include(include: list[str] | None) -> None:
    if include:
        raise InvalidRequest(f"include {include!r} is not supported: nothing can be included.",
                             code="unsupported_value", extra={"param": "include"})


class ConversationTurn:
    """A response's turn of a conversation, as ``api.submission.submit`` takes it (``History``): the
    conversation's items are the earlier turns of its prompt; its own input items (not
    ``instructions``, as on OpenAI) are appended when its task is created, its output items once
    the task is final (the store's ``settle``)."""

    def __init__(self, store: ConversationObjects, conversation_id: str, owner: str) -> None:
        self.store = store
        self.id = conversation_id
        self.owner = owner

    async def items(self) -> list[wire.InputItem]:
        if not ids.is_id(self.id, ids.CONVERSATION):  # nothing to look up (nor a key of one hash tag)
            raise not_found(self.id)
        await self.store.get(self.id, self.owner)
        if await self.store.settle(self.id):  # the turn of a response still being generated
            raise locked(self.id)
        return await self.store.items(self.id)

    async def keep(self, record: TaskRecord, request: wire.ResponseRequest) -> None:
        own = request.input[1:] if echo_of(request).get("instructions") else request.input
        await self.store.reserve(self.id, self.owner, Turn(record.response_id, record.id), with_ids(own))

    async def forget(self, record: TaskRecord) -> None:
        await self.store.forget(self.id, Turn(record.response_id, record.id))


def turn_of(store: ConversationObjects, request: wire.ResponseRequest, owner: str) -> ConversationTurn | None:
    """The turn of a translated ``POST /v1/responses`` request (None without ``conversation``)."""
    conversation_id = echo_of(request).get("conversation")
    return None if conversation_id is None else ConversationTurn(store, conversation_id, owner)
