"""A stored response's input items in OpenAI's item shapes, a page at a time, as
``GET /v1/responses/{id}/input_items`` answers them (the SDK's ``responses.input_items.list``).

The items are those of the response's own turn (not the earlier turns of its conversation), without
the system message that ``instructions`` became. An item sent without an ``id`` gets one derived from
its task's id and its place, the same at every reading, so that ``after`` can name it.
"""

from typing import Literal

from api.openai import objects as oa
from api.openai.translation import echo_in
from lmsp_core import wire
from lmsp_core.store.objects.conversationobjects import ITEM_PREFIXES
from lmsp_core.store.objects.conversations import StoredResponse
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest

MAX_PAGE = 100
Order = Literal["asc", "desc"]


def input_items(turn: StoredResponse) -> list[oa.InputItem]:
    numbered = list(enumerate(turn.input))
    if echo_in(turn.extensions).get("instructions"):
        numbered = numbered[1:]
    return [item_object(item, item.id or ids.derived_id(ITEM_PREFIXES[type(item)], f"{turn.task_id}/{index}"))
            for index, item in numbered]


def item_object(item: wire.InputItem, item_id: str) -> oa.InputItem:
    if isinstance(item, wire.Message):
        texts = [part.text for part in item.content if isinstance(part, wire.TEXT_PARTS)]
        part = oa.OutputText if item.role == "assistant" else oa.InputText
        return oa.InputMessage(id=item_id, role=item.role, content=[part(text=text) for text in texts])
    if isinstance(item, wire.FunctionCall):
        return oa.FunctionCall(id=item_id, call_id=item.call_id, name=item.name, arguments=item.arguments,
                               status="completed")
    if isinstance(item, wire.FunctionCallOutput):
        return oa.FunctionCallOutput(id=item_id, call_id=item.call_id, output=item.output)
    return oa.Reasoning(id=item_id, summary=[oa.SummaryText(text=part.text) for part in item.summary],
                        status="completed")


def page(items: list[oa.InputItem], *, limit: int, order: Order, after: str | None) -> oa.InputItemList:
    """The ``limit`` items after the item ``after`` names (from the start without it), in ``order``
    (``desc``: the last input item first)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((index + 1 for index, item in enumerate(ordered) if item.id == after), -1)
        if start < 0:
            raise InvalidRequest(f"after {after!r} names no input item of this response.", code="invalid_cursor",
                                 extra={"param": "after"})
    chosen = ordered[start:start + limit]
    return oa.InputItemList(data=chosen, first_id=chosen[0].id if chosen else None,
                            last_id=chosen[-1].id if chosen else None, has_more=start + limit < len(ordered))
