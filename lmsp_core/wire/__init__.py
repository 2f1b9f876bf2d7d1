"""LMSP 1.0 wire types (spec sections 6.1-6.5): requests, responses, events, tasks, models.

Requests are strict: unknown fields are rejected and constraints are declared with ``Meta`` so
that the API validates them while decoding. Output types always encode every field (``null``
included), as the spec's examples show.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

# Size limits (input items, content parts, tools, text length) are settings, checked after decoding
# by ``validation.check_limits`` so that each has its own problem code; the body size caps decoding.

Text = str
# an output item's ``status`` is there only on an item that a failure cut short ("incomplete"); input
# items accept it (and ignore it), so that output items can be sent back as they were returned
ItemStatus = Literal["incomplete"]
InputItemStatus = Literal["in_progress", "completed", "incomplete"]
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
ObjectId = Annotated[str, Meta(min_length=1, max_length=128)]


class _In(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag_field="type"):
    """Base of request-side tagged structs."""


# --- input content parts -------------------------------------------------------------------------


class InputText(_In, tag="input_text", frozen=True):
    text: Text


class OutputText(_In, tag="output_text", frozen=True):
    text: Text


class _Reserved(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Content types reserved for later LMSP versions: decoded (any fields) so that they can be
    refused with a precise code rather than a generic decoding error."""


class InputImage(_Reserved, tag="input_image", frozen=True):
    pass


class InputAudio(_Reserved, tag="input_audio", frozen=True):
    pass


class InputFile(_Reserved, tag="input_file", frozen=True):
    pass


ContentPart = InputText | OutputText | InputImage | InputAudio | InputFile
TEXT_PARTS = (InputText, OutputText)


class SummaryText(_In, tag="summary_text", frozen=True):
    text: Text


# --- input items -------------------------------------------------------------------------------


class Message(_In, tag="message", frozen=True):
    role: Literal["system", "user", "assistant"]
    content: list[ContentPart]
    id: ObjectId | None = None
    status: InputItemStatus | UnsetType = UNSET


class FunctionCall(_In, tag="function_call", frozen=True):
    call_id: ObjectId
    name: ToolName
    arguments: Text
    id: ObjectId | None = None
    status: InputItemStatus | UnsetType = UNSET


class FunctionCallOutput(_In, tag="function_call_output", frozen=True):
    call_id: ObjectId
    output: Text
    id: ObjectId | None = None


class Reasoning(_In, tag="reasoning", frozen=True):
    summary: list[SummaryText]
    id: ObjectId | None = None
    status: InputItemStatus | UnsetType = UNSET


InputItem = Message | FunctionCall | FunctionCallOutput | Reasoning


# --- request options ---------------------------------------------------------------------------


class TextFormat(_In, tag="text", frozen=True):
    pass


class JsonSchemaSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class JsonSchemaFormat(_In, tag="json_schema", frozen=True):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonSchemaFormat


class FunctionTool(_In, tag="function", frozen=True):
    name: ToolName
    description: Annotated[str, Meta(max_length=8192)] = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class NamedToolChoice(_In, tag="function", frozen=True):
    name: ToolName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice

# extension names and values are checked by lmsp_core.requests.extensions; the names' size bounds the
# LMSP-Ignored-Extensions header that reports unknown ones
ExtensionName = Annotated[str, Meta(min_length=1, max_length=128)]
ExtensionMap = Annotated[dict[ExtensionName, Any], Meta(max_length=64)]


class ResponseRequest(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Body of ``POST /lmsp/v1/responses`` and ``POST /lmsp/v1/tasks`` (6.1)."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    input: Annotated[list[InputItem], Meta(min_length=1)]
    stream: bool = False
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    store: bool = False
    previous_response_id: ObjectId | None = None
    extensions: ExtensionMap | None = None


# --- problems ----------------------------------------------------------------------------------


class Problem(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An RFC 9457 problem object with the LMSP ``code`` member."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    errors: list[dict[str, Any]] | None = None


# --- output ------------------------------------------------------------------------------------


class _Out(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of response-side tagged structs."""


class TopLogprob(Struct, frozen=True, kw_only=True):
    """One of the most likely tokens at a step, with its log-probability."""

    token: str  # the token's text (invalid UTF-8 as ``\\xNN`` escapes)
    logprob: float
    bytes: list[int]  # the token's exact bytes


class TokenLogprob(Struct, frozen=True, kw_only=True):
    """A generated token's log-probability and the most likely tokens at its step (an extension, only
    where the request asked: docs/protocol.md, "Log probabilities")."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class OutputTextPart(_Out, tag="output_text", frozen=True):
    text: str
    logprobs: list[TokenLogprob] | UnsetType = UNSET  # only where the request asked for them


class OutputMessage(_Out, tag="message", frozen=True):
    id: str
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart] = msgspec.field(default_factory=list)
    status: ItemStatus | UnsetType = UNSET


class OutputFunctionCall(_Out, tag="function_call", frozen=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus | UnsetType = UNSET


class SummaryTextPart(_Out, tag="summary_text", frozen=True):
    text: str


class OutputReasoning(_Out, tag="reasoning", frozen=True):
    id: str
    summary: list[SummaryTextPart] = msgspec.field(default_factory=list)
    status: ItemStatus | UnsetType = UNSET


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning

ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]


class InputTokensDetails(Struct, frozen=True, kw_only=True):
    cached_tokens: int  # prompt tokens whose keys and values the worker already held (not computed again)


class OutputTokensDetails(Struct, frozen=True, kw_only=True):
    reasoning_tokens: int


class Usage(Struct, frozen=True, kw_only=True, omit_defaults=True):
    input_tokens: int
    output_tokens: int  # reasoning tokens included
    total_tokens: int
    # not part of LMSP 1.0 (clients ignore unknown fields): only where part of the prompt was cached,
    # and for models with a reasoning format
    input_tokens_details: InputTokensDetails | None = None
    output_tokens_details: OutputTokensDetails | None = None


class IncompleteDetails(Struct, frozen=True, kw_only=True):
    reason: str


class Response(Struct, frozen=True, kw_only=True):
    """The response object (6.2)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    usage: Usage | None
    error: Problem | None = None
    incomplete_details: IncompleteDetails | None = None
    # not part of LMSP 1.0 (clients ignore unknown fields): the request's x-metadata, only where it had some
    metadata: dict[str, str] | UnsetType = UNSET


class DeletedResponse(Struct, frozen=True, kw_only=True):
    """The answer of ``DELETE /lmsp/v1/responses/{id}`` (and of ``/v1``'s, which is OpenAI's shape)."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# --- stream events (6.3) -------------------------------------------------------------------------


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

# --- tasks ---------------------------------------------------------------------------------------

TaskStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


class Task(Struct, frozen=True, kw_only=True):
    """The task object (tasks API; see docs/protocol.md)."""

    id: str
    object: Literal["task"] = "task"
    status: TaskStatus
    created_at: int
    started_at: int | None = None
    finished_at: int | None = None
    model: str
    response_id: str
    response: Response | None = None
    error: Problem | None = None
    metadata: dict[str, str] | UnsetType = UNSET  # the request's x-metadata, only where it had some
    batch_id: str | UnsetType = UNSET  # the batch (OpenAI's Batch API) whose line it runs, if any


class TaskList(Struct, frozen=True, kw_only=True):
    """A page of ``GET /lmsp/v1/tasks``: newest first; ``next_cursor`` asks for the next page."""

    object: Literal["list"] = "list"
    data: list[Task]
    has_more: bool = False
    next_cursor: str | None = None


# --- models --------------------------------------------------------------------------------------

Capability = Literal["streaming", "tools", "structured_output", "conversations"]


# available: a ready worker serves it; warming: its workers are still warming up (compiling)
ModelStatus = Literal["available", "warming", "unavailable"]


class ModelObject(Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    context_window: int
    max_output_tokens: int
    capabilities: list[str]
    status: ModelStatus
    workers: int


class ModelList(Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelObject]


encoder = msgspec.json.Encoder()
