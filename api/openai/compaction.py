"""``POST /v1/responses/compact``: a conversation made short by the model itself.

The conversation is the request's ``input`` after the turns that ``previous_response_id`` continues
(either, or both). The summary is generated as any response is: a task of its own (direct, not
stored) whose input is the conversation, then an instruction to summarise it; a worker runs it and
the route waits for its final event. The answer is OpenAI's ``response.compaction`` object: every
user message of the conversation, then one ``compaction`` item with the summary
(``api.openai.compactionitem``), a list the next ``POST /v1/responses`` takes as its ``input``.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from api.openai import objects as oa
from api.openai.compactionitem import CompactionItem, new_item
from api.openai.errors import FailedGeneration
from api.openai.rendering import usage
from api.openai.translation import input_items
from lmsp_core import wire
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.store.objects.conversations import StoredResponse, context
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire import ids
from lmsp_core.wire.errors import GenerationFailed, InvalidRequest

SUMMARY_TOKENS = 2048  # the summary's budget, within the model's own limit
INSTRUCTION = (
    "Compact the conversation above so that it can continue without it. Write a concise summary that keeps "
    "every fact, decision, name, number and open question, what the user asked for and what was already "
    "answered or done. Answer with the summary only."
)


class CompactRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Body of ``POST /v1/responses/compact`` (Open Responses' ``CompactResponseMethodPublicBody``)."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    instructions: str | None = None


class Compacted(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's ``response.compaction`` object (Open Responses' ``CompactResource``)."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    output: list[oa.InputMessage | CompactionItem]
    created_at: int
    usage: oa.Usage


def conversation(body: CompactRequest, chain: list[StoredResponse]) -> list[wire.InputItem]:
    """The conversation to compact: the earlier turns' items, then the request's own input."""
    if body.input is None and body.previous_response_id is None:
        raise InvalidRequest("Missing required parameter: 'input' (or 'previous_response_id').",
                             extra={"param": "input"})
    return context(chain, input_items(body.input) if body.input is not None else [])


def summarising_request(body: CompactRequest, spec: ModelSpec, items: list[wire.InputItem]) -> wire.ResponseRequest:
    """The task that writes the summary: the conversation (after ``instructions``, if any), then the
    instruction to compact it."""
    head = [wire.Message(role="system", content=[wire.InputText(text=body.instructions)])] \
        if body.instructions is not None else []
    ask = wire.Message(role="user", content=[wire.InputText(text=INSTRUCTION)])
    return wire.ResponseRequest(model=body.model, input=[*head, *items, ask], store=False,
                                max_output_tokens=min(SUMMARY_TOKENS, spec.max_output_tokens))


def compacted(record: TaskRecord, items: list[wire.InputItem]) -> Compacted:
    """The answer, from the summarising task's final record: the user messages of ``items``, then the summary."""
    final = record.response_object()
    if record.status == "failed":
        raise FailedGeneration(record.problem() or GenerationFailed("Generation failed.").problem())
    if final is None:
        raise GenerationFailed("The summary of the conversation was lost before it could be returned.")
    summary = "".join(part.text for item in final.output if isinstance(item, wire.OutputMessage)
                      for part in item.content)
    kept: list[oa.InputMessage | CompactionItem] = [
        _user_message(item, item.id or ids.derived_id(ids.MESSAGE, f"{record.id}/{index}"))
        for index, item in enumerate(items) if isinstance(item, wire.Message) and item.role == "user"]
    spent = usage(final.usage) or oa.Usage(input_tokens=0, output_tokens=0, total_tokens=0)
    return Compacted(id=record.response_id, output=[*kept, new_item(summary)], created_at=int(record.created_at),
                     usage=spent)


def _user_message(item: wire.Message, item_id: str) -> oa.InputMessage:
    texts = [part.text for part in item.content if isinstance(part, wire.TEXT_PARTS)]
    return oa.InputMessage(id=item_id, role="user", content=[oa.InputText(text=text) for text in texts])
