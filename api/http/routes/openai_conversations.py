"""OpenAI's Conversations API: ``POST /v1/conversations``, ``GET``, ``POST`` (metadata) and ``DELETE
/v1/conversations/{id}``, and its items: ``GET`` and ``POST /v1/conversations/{id}/items``, ``GET`` and
``DELETE /v1/conversations/{id}/items/{item_id}``.

Conversations live in Redis per principal (``lmsp_core.store.objects.conversationobjects``); another
principal's are ``404 conversation_not_found``. ``POST /v1/responses`` with ``conversation`` adds each
response's turn (``api.openai.conversations``).
"""

import time
from typing import Annotated, Any

import msgspec
from litestar import Controller, Response, delete, get, post
from litestar.params import Body, Parameter

from api.http.openapi import openai as docs
from api.openai import PREFIX
from api.openai import conversations as oc
from api.openai.errors import errors_only
from api.openai.inputitems import Order
from api.openai.objects import InputItem, InputItemList
from api.process import Services
from lmsp_core.store.objects.conversationobjects import not_found
from lmsp_core.store.tenants import credentials
from lmsp_core.wire import ids

_INCLUDE = Annotated[list[str] | None, Parameter(
    description="nothing can be included: absent only",
    schema_extra={"type": "array", "oneOf": None, "items": {"type": "string"}, "maxItems": 0})]
_ERRORS = (*docs.COMMON_ERRORS, "conversation_not_found")


def _json(value: Any) -> Response[Any]:
    return Response(content=msgspec.json.encode(value), media_type="application/json")


def _checked(conversation_id: str) -> str:
    """A conversation id, or ``404`` at once for what cannot be one."""
    if not ids.is_id(conversation_id, ids.CONVERSATION):
        raise not_found(conversation_id)
    return conversation_id


class OpenAIConversationsController(Controller):
    path = f"{PREFIX}/conversations"
    tags = ["openai"]

    @post(status_code=200, summary="Create a conversation (OpenAI)", opt={"scope": credentials.RESPONSES_WRITE},
          after_request=errors_only,
          description="OpenAI's `conversations.create`: a conversation of the caller, with up to 20 `items` (input "
                      "items, as `POST /v1/responses` takes them) and `metadata`. Kept `LMSP_RESPONSE_RETENTION` "
                      "from its last change.",
          responses={200: docs.ok(oc.Conversation, "The conversation", docs.CONVERSATION),
                     **docs.errors(*docs.COMMON_ERRORS, "unsupported_parameter", "unsupported_value",
                                   "unsupported_content_type", "object_above_max_properties",
                                   "string_above_max_length")})
    async def create_conversation(self,
                                  data: Annotated[oc.ConversationCreate, Body(examples=docs.CONVERSATION_REQUESTS)],
                                  services: Services, owner: str) -> Response[Any]:
        items = oc.new_items(data.items)
        record = await services.conversation_objects.create(owner, int(time.time()), oc.metadata(data.metadata),
                                                            items)
        return _json(oc.conversation_object(record))

    @get("/{conversation_id:str}", summary="Retrieve a conversation (OpenAI)",
         opt={"scope": credentials.RESPONSES_READ}, after_request=errors_only,
         description="OpenAI's `conversations.retrieve`.",
         responses={200: docs.ok(oc.Conversation, "The conversation", docs.CONVERSATION), **docs.errors(*_ERRORS)})
    async def retrieve_conversation(self, conversation_id: str, services: Services, owner: str) -> Response[Any]:
        record = await services.conversation_objects.get(_checked(conversation_id), owner)
        return _json(oc.conversation_object(record))

    @post("/{conversation_id:str}", status_code=200, summary="Update a conversation (OpenAI)",
          opt={"scope": credentials.RESPONSES_WRITE}, after_request=errors_only,
          description="OpenAI's `conversations.update`: its `metadata`, replaced whole (`null`: none).",
          responses={200: docs.ok(oc.Conversation, "The conversation", docs.CONVERSATION),
                     **docs.errors(*_ERRORS, "unsupported_parameter", "object_above_max_properties",
                                   "string_above_max_length")})
    async def update_conversation(self, conversation_id: str,
                                  data: Annotated[oc.ConversationUpdate, Body(examples=docs.CONVERSATION_UPDATES)],
                                  services: Services, owner: str) -> Response[Any]:
        record = await services.conversation_objects.update(_checked(conversation_id), owner,
                                                            oc.metadata(data.metadata))
        return _json(oc.conversation_object(record))

    @delete("/{conversation_id:str}", status_code=200, summary="Delete a conversation (OpenAI)",
            opt={"scope": credentials.RESPONSES_WRITE}, after_request=errors_only,
            description="OpenAI's `conversations.delete`: the conversation and its items; the responses of its "
                        "turns stay. A second delete is `404`.",
            responses={200: docs.ok(oc.ConversationDeleted, "The conversation was deleted",
                                    docs.CONVERSATION_DELETED), **docs.errors(*_ERRORS)})
    async def delete_conversation(self, conversation_id: str, services: Services, owner: str) -> Response[Any]:
        await services.conversation_objects.delete(_checked(conversation_id), owner)
        return _json(oc.ConversationDeleted(id=conversation_id))

    @get("/{conversation_id:str}/items", summary="List a conversation's items (OpenAI)",
         opt={"scope": credentials.RESPONSES_READ}, after_request=errors_only,
         description="OpenAI's `conversations.items.list`: `limit` per page (1-100, 20), newest first (`order=desc`, "
                     "the default) or in order (`asc`); `after` is the `id` of the last item seen.",
         responses={200: docs.ok(InputItemList, "A page of items", docs.CONVERSATION_ITEMS),
                    **docs.errors(*_ERRORS, "unsupported_value", "invalid_cursor")})
    async def list_items(
        self, conversation_id: str, services: Services, owner: str,
        limit: Annotated[int, Parameter(ge=1, le=oc.MAX_PAGE, description="items per page")] = 20,
        order: Annotated[Order, Parameter(description="`desc`: the last item first")] = "desc",
        after: Annotated[str | None, Parameter(description="the `id` of the item to list after")] = None,
        include: _INCLUDE = None,
    ) -> Response[Any]:
        oc.check_include(include)
        store = services.conversation_objects
        await store.get(_checked(conversation_id), owner)
        await store.settle(conversation_id)
        items, more = await store.page(conversation_id, limit=limit, order=order, after=after)
        return _json(oc.item_list(items, more))

    @post("/{conversation_id:str}/items", status_code=200, summary="Add items to a conversation (OpenAI)",
          opt={"scope": credentials.RESPONSES_WRITE}, after_request=errors_only,
          description="OpenAI's `conversations.items.create`: up to 20 input items appended, answered as a list of "
                      "the items added, with their ids.",
          responses={200: docs.ok(InputItemList, "The items added", docs.CONVERSATION_ITEMS),
                     **docs.errors(*_ERRORS, "unsupported_parameter", "unsupported_value",
                                   "unsupported_content_type")})
    async def create_items(self, conversation_id: str,
                           data: Annotated[oc.ItemsCreate, Body(examples=docs.ITEMS_REQUESTS)], services: Services,
                           owner: str, include: _INCLUDE = None) -> Response[Any]:
        oc.check_include(include)
        items = oc.new_items(data.items, required=True)
        store = services.conversation_objects
        await store.settle(_checked(conversation_id))  # a final response's output comes before these items
        await store.append(conversation_id, owner, items)
        return _json(oc.item_list(items))

    @get("/{conversation_id:str}/items/{item_id:str}", summary="Retrieve a conversation's item (OpenAI)",
         opt={"scope": credentials.RESPONSES_READ}, after_request=errors_only,
         description="OpenAI's `conversations.items.retrieve`.",
         responses={200: docs.ok(InputItem, "The item", docs.CONVERSATION_ITEM),
                    **docs.errors(*_ERRORS, "unsupported_value", "item_not_found")})
    async def retrieve_item(self, conversation_id: str, item_id: str, services: Services, owner: str,
                            include: _INCLUDE = None) -> Response[Any]:
        oc.check_include(include)
        store = services.conversation_objects
        await store.settle(_checked(conversation_id))
        return _json(oc.item(await store.item(conversation_id, owner, item_id)))

    @delete("/{conversation_id:str}/items/{item_id:str}", status_code=200,
            summary="Delete a conversation's item (OpenAI)", opt={"scope": credentials.RESPONSES_WRITE},
            after_request=errors_only,
            description="OpenAI's `conversations.items.delete`: answers the conversation.",
            responses={200: docs.ok(oc.Conversation, "The conversation", docs.CONVERSATION),
                       **docs.errors(*_ERRORS, "item_not_found")})
    async def delete_item(self, conversation_id: str, item_id: str, services: Services, owner: str) -> Response[Any]:
        store = services.conversation_objects
        await store.settle(_checked(conversation_id))
        await store.delete_item(conversation_id, owner, item_id)
        return _json(oc.conversation_object(await store.get(conversation_id, owner)))
