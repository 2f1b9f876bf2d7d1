"""What the ``/v1`` routes answer, in OpenAI's shapes: the response object and its stream events,
input items, models (chat completions: ``api.openai.chatobjects``). Every field these types declare is always sent
(``null`` included), as OpenAI does; the tests validate them with the ``openai`` package's own models.
"""

from typing import Any, Literal

import msgspec
from msgspec import Struct

from lmsp_core.wire import TokenLogprob

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
ServiceTier = Literal["default", "flex", "priority"]  # the tier a request was served with


class _Obj(Struct, frozen=True, kw_only=True):
    pass


class _Typed(Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


# --- the response object -------------------------------------------------------------------------


class OutputText(_Typed, tag="output_text", frozen=True, kw_only=True):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)  # where include asked for them


class SummaryText(_Typed, tag="summary_text", frozen=True, kw_only=True):
    text: str


class Message(_Typed, tag="message", frozen=True, kw_only=True):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = msgspec.field(default_factory=list)


class FunctionCall(_Typed, tag="function_call", frozen=True, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class Reasoning(_Typed, tag="reasoning", frozen=True, kw_only=True):
    id: str
    summary: list[SummaryText]
    status: ItemStatus


OutputItem = Message | FunctionCall | Reasoning


class InputTokensDetails(_Obj, frozen=True, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(_Obj, frozen=True, kw_only=True):
    reasoning_tokens: int = 0


class Usage(_Obj, frozen=True, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class ResponseError(_Obj, frozen=True, kw_only=True):
    """``code`` is OpenAI's (``server_error``, or ``invalid_prompt`` for a request the worker refused);
    ``type`` is the service's own code (``worker_lost``, ``context_length_exceeded``, ...)."""

    code: Literal["server_error", "invalid_prompt"]
    message: str
    param: str | None = None
    type: str | None = None


class IncompleteDetails(_Obj, frozen=True, kw_only=True):
    reason: str


class FunctionTool(_Typed, tag="function", frozen=True, kw_only=True):
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool | None


class NamedFunction(_Typed, tag="function", frozen=True, kw_only=True):
    name: str


class TextFormat(_Typed, tag="text", frozen=True, kw_only=True):
    pass


class JsonObjectFormat(_Typed, tag="json_object", frozen=True, kw_only=True):
    pass


class JsonSchemaFormat(_Typed, tag="json_schema", frozen=True, kw_only=True):
    name: str
    schema: dict[str, Any]
    description: str | None
    strict: bool | None


class TextConfig(_Obj, frozen=True, kw_only=True):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat


class ConversationRef(_Obj, frozen=True, kw_only=True):
    id: str


class Response(_Obj, frozen=True, kw_only=True):
    """The response object of ``/v1/responses``; ``id`` is the LMSP response id."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    completed_at: int | None = None
    model: str
    output: list[OutputItem]
    usage: Usage | None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = False  # the service's default: one call per response
    temperature: float
    top_p: float
    # Open Responses' ResponseResource requires these five: no penalty is applied (a request may only
    # ask for 0), top_logprobs is what the request asked for, and neither reasoning nor max_tool_calls
    # is a parameter this service takes (400 unsupported_parameter), so both are null
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    reasoning: None = None
    max_tool_calls: None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    tools: list[FunctionTool] = msgspec.field(default_factory=list)
    text: TextConfig
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    conversation: ConversationRef | msgspec.UnsetType = msgspec.UNSET  # left out without one
    background: bool
    store: bool
    truncation: Literal["disabled"] = "disabled"
    service_tier: ServiceTier = "default"
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None


class InputTokens(_Obj, frozen=True, kw_only=True):
    """The answer of ``POST /v1/responses/input_tokens``: the tokens of the prompt a response with
    the same input, instructions, tools and conversation would be given."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


# --- stream events ---------------------------------------------------------------------------------
# Each event has the `sequence_number` that docs/protocol.md ("OpenAI compatibility") defines.


class ResponseCreated(_Typed, tag="response.created", frozen=True, kw_only=True):
    sequence_number: int
    response: Response


class ResponseInProgress(_Typed, tag="response.in_progress", frozen=True, kw_only=True):
    sequence_number: int
    response: Response


class ResponseCompleted(_Typed, tag="response.completed", frozen=True, kw_only=True):
    sequence_number: int
    response: Response


class ResponseIncomplete(_Typed, tag="response.incomplete", frozen=True, kw_only=True):
    sequence_number: int
    response: Response


class ResponseFailed(_Typed, tag="response.failed", frozen=True, kw_only=True):
    sequence_number: int
    response: Response


class OutputItemAdded(_Typed, tag="response.output_item.added", frozen=True, kw_only=True):
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(_Typed, tag="response.output_item.done", frozen=True, kw_only=True):
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(_Typed, tag="response.content_part.added", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Typed, tag="response.content_part.done", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Typed, tag="response.output_text.delta", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)


class OutputTextDone(_Typed, tag="response.output_text.done", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)


class ArgumentsDelta(_Typed, tag="response.function_call_arguments.delta", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(_Typed, tag="response.function_call_arguments.done", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class SummaryPartAdded(_Typed, tag="response.reasoning_summary_part.added", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class SummaryPartDone(_Typed, tag="response.reasoning_summary_part.done", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class SummaryTextDelta(_Typed, tag="response.reasoning_summary_text.delta", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    delta: str


class SummaryTextDone(_Typed, tag="response.reasoning_summary_text.done", frozen=True, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    text: str


class StreamError(_Typed, tag="error", frozen=True, kw_only=True):
    """Not part of the log (the store went away): it repeats the sequence number of the last event
    sent, so that ``starting_after`` that number resumes where the stream broke."""

    sequence_number: int
    code: str
    message: str
    param: str | None = None


StreamEvent = (ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete | ResponseFailed
               | OutputItemAdded | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta
               | OutputTextDone | ArgumentsDelta | ArgumentsDone | SummaryPartAdded | SummaryPartDone
               | SummaryTextDelta | SummaryTextDone | StreamError)


# --- a response's input items (GET /v1/responses/{id}/input_items) and its deletion ------------------


class InputText(_Typed, tag="input_text", frozen=True, kw_only=True):
    text: str


class InputMessage(_Typed, tag="message", frozen=True, kw_only=True):
    """A message of the input: ``input_text`` parts, or an assistant's ``output_text`` parts."""

    id: str
    role: Literal["user", "system", "assistant"]
    content: list[InputText | OutputText]
    status: ItemStatus = "completed"


class FunctionCallOutput(_Typed, tag="function_call_output", frozen=True, kw_only=True):
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


InputItem = InputMessage | FunctionCall | FunctionCallOutput | Reasoning


class InputItemList(_Obj, frozen=True, kw_only=True):
    """A page of input items; ``first_id`` and ``last_id`` are null on an empty page."""

    object: Literal["list"] = "list"
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


# --- models ------------------------------------------------------------------------------------------


class Model(_Obj, frozen=True, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "lmsp"


class ModelList(_Obj, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Model]


encoder = msgspec.json.Encoder()
