"""OpenAI's Conversations API through the official ``openai`` package: conversations and their items
(create, retrieve, update, delete, the SDK's cursors), responses that continue one (sync, streamed,
background, over a WebSocket), and its errors; per principal and on both Redis deployments with plain HTTP.

Every object the client receives is validated again with the package's own pydantic models. The done-when
check with a killed worker is in test_reclaim.py (its stack kills workers).
"""

import asyncio
import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.conversations import Conversation, ConversationItem
from openai.types.responses import Response
from websockets.asyncio.client import connect

from lmsp_core.store import keys
from tests.backends import backend, client, eager_worker, make_token, redis, redis_settings, secure, served  # noqa: F401 (fixtures: both deployments)
from tests.support import Api, TokenFactory, bearer

MODEL = "tiny-random"
ITEM: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ConversationItem)


def texts(items: list[Any]) -> list[tuple[str, str]]:
    """(role, text) of each message item."""
    return [(item.role, "".join(part.text for part in item.content)) for item in items]


async def all_items(sdk: openai.AsyncOpenAI, conversation_id: str, **params: Any) -> list[Any]:
    """Every item, a page at a time through the SDK's cursors, each validated with the SDK's model."""
    return [ITEM.validate_python(item.to_dict())
            async for item in sdk.conversations.items.list(conversation_id, **params)]


async def test_a_conversation_and_its_items(sdk: openai.AsyncOpenAI) -> None:
    created = await sdk.conversations.create(metadata={"topic": "queues"}, items=[
        {"type": "message", "role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi there"}]},
        {"role": "developer", "content": "Be brief."}])
    Conversation.model_validate(created.to_dict())
    assert created.id.startswith("conv_") and created.metadata == {"topic": "queues"}
    assert await sdk.conversations.retrieve(created.id) == created
    updated = await sdk.conversations.update(created.id, metadata={"topic": "stacks", "n": "2"})
    assert updated.metadata == {"topic": "stacks", "n": "2"} and updated.created_at == created.created_at
    added = await sdk.conversations.items.create(created.id, items=[
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"}])
    assert [item.type for item in added.data] == ["function_call", "function_call_output"]
    assert added.first_id == added.data[0].id and added.last_id == added.data[1].id

    ordered = await all_items(sdk, created.id, order="asc", limit=2)  # three pages
    assert texts(ordered[:3]) == [("user", "Hello"), ("assistant", "Hi there"), ("system", "Be brief.")]
    assert [item.id for item in ordered[3:]] == [item.id for item in added.data]
    assert len({item.id for item in ordered}) == 5
    newest_first = await all_items(sdk, created.id)  # desc, the default
    assert [item.id for item in newest_first] == [item.id for item in ordered][::-1]
    page = await sdk.conversations.items.list(created.id, order="asc", limit=2, after=ordered[1].id)
    assert [item.id for item in page.data] == [ordered[2].id, ordered[3].id] and page.has_more

    one = await sdk.conversations.items.retrieve(ordered[1].id, conversation_id=created.id)
    assert ITEM.validate_python(one.to_dict()) == ordered[1]
    assert await sdk.conversations.items.delete(ordered[1].id, conversation_id=created.id) == updated
    assert [item.id for item in await all_items(sdk, created.id, order="asc")] == [
        item.id for item in ordered if item.id != ordered[1].id]
    with pytest.raises(openai.NotFoundError) as gone:
        await sdk.conversations.items.retrieve(ordered[1].id, conversation_id=created.id)
    assert gone.value.code == "item_not_found"

    deleted = await sdk.conversations.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "conversation.deleted")
    for call in (sdk.conversations.retrieve(created.id), sdk.conversations.delete(created.id),
                 sdk.conversations.items.create(created.id, items=[{"role": "user", "content": "Hi"}])):
        with pytest.raises(openai.NotFoundError) as missing:
            await call
        assert missing.value.code == "conversation_not_found"


async def test_responses_continue_a_conversation(sdk: openai.AsyncOpenAI) -> None:
    conversation = await sdk.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    first = Response.model_validate((await sdk.responses.create(
        model=MODEL, conversation=conversation.id, input="Hello", instructions="Be brief.",
        max_output_tokens=5)).to_dict())
    assert first.conversation is not None and first.conversation.id == conversation.id
    # the earlier turns are the prompt's, as if sent by hand (instructions lead their own turn, as with
    # previous_response_id)
    by_hand = await sdk.responses.create(model=MODEL, store=False, max_output_tokens=5, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"}])
    assert first.output_text == by_hand.output_text
    assert first.usage is not None and by_hand.usage is not None
    assert first.usage.input_tokens == by_hand.usage.input_tokens

    second = await sdk.responses.create(model=MODEL, conversation={"id": conversation.id}, input="My name?",
                                        max_output_tokens=6, stream=True)
    events = [event async for event in second]
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.incomplete" and final.conversation.id == conversation.id

    items = await all_items(sdk, conversation.id, order="asc")
    # instructions are not an item, as on OpenAI; the output items keep their ids
    assert texts(items) == [("user", "My name is Ada."), ("user", "Hello"), ("assistant", first.output_text),
                            ("user", "My name?"), ("assistant", final.output_text)]
    assert [items[2].id, items[4].id] == [first.output[0].id, final.output[0].id]
    input_items = await sdk.responses.input_items.list(first.id)  # the response's own turn still reads back
    assert [item.content[0].text for item in input_items.data] == ["Hello"]  # type: ignore[union-attr]


async def test_a_background_response_is_appended_once_final(sdk: openai.AsyncOpenAI, redis: Any) -> None:
    conversation = await sdk.conversations.create()
    queued = await sdk.responses.create(model=MODEL, conversation=conversation.id, input="A long story.",
                                        max_output_tokens=1000, background=True)
    assert queued.conversation is not None and queued.conversation.id == conversation.id
    # its input is there at once; its output takes its place when it is final
    assert texts(await all_items(sdk, conversation.id)) == [("user", "A long story.")]
    with pytest.raises(openai.BadRequestError) as locked:  # one response at a time
        await sdk.responses.create(model=MODEL, conversation=conversation.id, input="And?", max_output_tokens=2)
    assert locked.value.code == "conversation_locked" and locked.value.param == "conversation"
    added = await sdk.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Later"}])
    done = await sdk.responses.cancel(queued.id)
    assert done.status in ("cancelled", "incomplete")
    # nobody reads the conversation meanwhile: the consumer of ended tasks settles the turn
    async with asyncio.timeout(30):
        while await redis.hlen(keys.conversation_turns(conversation.id)):
            await asyncio.sleep(0.05)
    items = await all_items(sdk, conversation.id, order="asc")
    output = [("assistant", done.output_text)] if done.output else []
    assert texts(items) == [("user", "A long story."), *output, ("user", "Later")]
    assert [item.id for item in items[1:]] == [item.id for item in done.output] + [added.data[0].id]
    after = await sdk.responses.create(model=MODEL, conversation=conversation.id, input="More", max_output_tokens=2,
                                       store=False)  # the conversation keeps the turn all the same
    assert len(await all_items(sdk, conversation.id)) == len(items) + 2 and after.status == "incomplete"


async def test_a_websocket_response_continues_a_conversation(api: Api, sdk: openai.AsyncOpenAI) -> None:
    conversation = await sdk.conversations.create(items=[{"role": "user", "content": "Hello"}])
    url = api.url.replace("http://", "ws://", 1) + "/v1/responses"
    async with connect(url, open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "Go on",
                                  "conversation": conversation.id, "max_output_tokens": 3}))
        events = [json.loads(await asyncio.wait_for(ws.recv(), 60))]
        while events[-1]["type"] not in ("response.completed", "response.incomplete", "response.failed", "error"):
            events.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
    final = Response.model_validate(events[-1]["response"])
    assert final.conversation is not None and final.conversation.id == conversation.id
    assert texts(await all_items(sdk, conversation.id, order="asc")) == [
        ("user", "Hello"), ("user", "Go on"), ("assistant", final.output_text)]


async def test_conversation_errors(sdk: openai.AsyncOpenAI) -> None:
    conversation = await sdk.conversations.create()
    first = await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as both:
        await sdk.responses.create(model=MODEL, input="Hi", conversation=conversation.id,
                                   previous_response_id=first.id)
    assert (both.value.code, both.value.param) == ("mutually_exclusive_parameters", "conversation")
    for unknown in ("conv_01J8M6Q4W2T7N5R3V9X1Z8B0DF", "nonsense"):
        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.responses.create(model=MODEL, input="Hi", conversation=unknown)
        assert (missing.value.code, missing.value.param) == ("conversation_not_found", "conversation")
    with pytest.raises(openai.BadRequestError) as image:
        await sdk.conversations.create(items=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])
    assert (image.value.code, image.value.param) == ("unsupported_content_type", "items[0].content[0].type")
    with pytest.raises(openai.BadRequestError) as many:
        await sdk.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Hi"}] * 21)
    assert many.value.param == "items"
    with pytest.raises(openai.BadRequestError) as cursor:
        await sdk.conversations.items.list(conversation.id, after="msg_01J8M6Q4W2T7N5R3V9X1Z8B0DF")
    assert cursor.value.code == "invalid_cursor"
    with pytest.raises(openai.BadRequestError) as metadata:
        await sdk.conversations.update(conversation.id, metadata={f"k{n}": "v" for n in range(17)})
    assert metadata.value.code == "object_above_max_properties"
    with pytest.raises(openai.BadRequestError) as unknown_field:
        await sdk.conversations.create(extra_body={"tools": []})
    assert (unknown_field.value.code, unknown_field.value.param) == ("unsupported_parameter", "tools")
    # the failed requests left nothing behind
    assert await all_items(sdk, conversation.id) == []


async def test_conversations_belong_to_their_principal(secure: httpx.AsyncClient, make_token: TokenFactory) -> None:
    """On both deployments: a cluster keeps each conversation's keys, and its scripts, in one slot."""
    alice, _ = await make_token()
    bob, _ = await make_token()
    created = await secure.post("/v1/conversations", headers=bearer(alice), json={
        "items": [{"role": "user", "content": "Hello"}]})
    assert created.status_code == 200, created.text
    conversation_id = created.json()["id"]
    answered = await secure.post("/v1/responses", headers=bearer(alice), json={
        "model": MODEL, "input": "Go on", "conversation": conversation_id, "max_output_tokens": 3})
    assert answered.status_code == 200 and answered.json()["conversation"] == {"id": conversation_id}
    listed = await secure.get(f"/v1/conversations/{conversation_id}/items", headers=bearer(alice),
                              params={"order": "asc"})
    assert [item["role"] for item in listed.json()["data"]] == ["user", "user", "assistant"]
    item_id = listed.json()["data"][0]["id"]
    for method, path, body in (
            ("GET", "", None), ("POST", "", {"metadata": {}}), ("DELETE", "", None), ("GET", "/items", None),
            ("POST", "/items", {"items": [{"role": "user", "content": "Hi"}]}), ("GET", f"/items/{item_id}", None),
            ("DELETE", f"/items/{item_id}", None)):
        theirs = await secure.request(method, f"/v1/conversations/{conversation_id}{path}", headers=bearer(bob),
                                      json=body)
        assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "conversation_not_found", path
    refused = await secure.post("/v1/responses", headers=bearer(bob), json={
        "model": MODEL, "input": "Hi", "conversation": conversation_id, "max_output_tokens": 2})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "conversation"
    again = await secure.get(f"/v1/conversations/{conversation_id}/items", headers=bearer(alice))
    assert again.json()["data"] == listed.json()["data"][::-1]  # bob changed nothing
