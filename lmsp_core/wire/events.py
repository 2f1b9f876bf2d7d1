"""LMSP 1.0 stream events (6.3): each event's data, and the event names."""

from typing import Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from lmsp_core.wire.responses import IncompleteDetails, OutputItem, Problem, ResponseStatus, TokenLogprob, Usage


class ResponseCreated(Struct, frozen=True, kw_only=True):
    response_id: str
    status: ResponseStatus = "in_progress"


class OutputItemAdded(Struct, frozen=True, kw_only=True):
    response_id: str
    output_index: int
    item: OutputItem


class OutputTextDelta(Struct, frozen=True, kw_only=True):
    response_id: str
    item_id: str
    delta: str
    logprobs: list[TokenLogprob] | UnsetType = UNSET  # the tokens whose text the delta completes, where asked


class ReasoningSummaryTextDelta(Struct, frozen=True, kw_only=True):
    """Extra event (6.3 allows them): text appended to the summary of a reasoning item."""

    response_id: str
    item_id: str
    delta: str


class OutputItemDone(Struct, frozen=True, kw_only=True):
    response_id: str
    output_index: int
    item: OutputItem


class ResponseCompleted(Struct, frozen=True, kw_only=True):
    response_id: str
    status: ResponseStatus
    usage: Usage


class ResponseIncomplete(Struct, frozen=True, kw_only=True):
    response_id: str
    status: ResponseStatus
    incomplete_details: IncompleteDetails
    usage: Usage


class ResponseFailed(Struct, frozen=True, kw_only=True):
    response_id: str
    status: ResponseStatus
    error: Problem
    # what the stream delivered before the failure (docs/protocol.md): the failed response's output
    output: list[OutputItem] = msgspec.field(default_factory=list)


class ResponseCancelled(Struct, frozen=True, kw_only=True):
    response_id: str
    status: ResponseStatus


class ErrorEventData(Struct, frozen=True, kw_only=True):
    error: Problem


class TaskQueued(Struct, frozen=True, kw_only=True):
    """Extra event (no id, not part of the task's log) sent while a task waits in its queue, only to a
    client that asks for it (``?queue_events=true``); others get the position as a comment line."""

    task_id: str
    status: Literal["queued"] = "queued"
    queue_position: int | None


CREATED = "response.created"
ITEM_ADDED = "response.output_item.added"
TEXT_DELTA = "response.output_text.delta"
REASONING_DELTA = "response.reasoning_summary_text.delta"
ITEM_DONE = "response.output_item.done"
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
CANCELLED = "response.cancelled"
ERROR = "error"
QUEUED = "task.queued"

FINAL_EVENTS = frozenset({COMPLETED, INCOMPLETE, FAILED, CANCELLED})
