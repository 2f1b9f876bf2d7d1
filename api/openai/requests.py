"""The bodies of ``POST /v1/responses`` and ``POST /v1/chat/completions`` as this service accepts them.

Only the parameters the service honours are fields; any other is refused while decoding with
``400 unsupported_parameter`` naming it (never silently ignored). A few parameters are accepted
only with the value that asks for what the service does anyway (``n: 1``, ``truncation: disabled``,
...); ``api.openai.translation`` refuses other values with ``400 unsupported_value``. Lengths of
``metadata``, ``user``, ... are checked there too, so that they fail with OpenAI's codes.
Input items and chat messages are decoded item by item there, because OpenAI's shorthand message
(``{"role": "user", "content": "hi"}``) has no ``type`` tag.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

Model = Annotated[str, Meta(min_length=1, max_length=256)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
Tokens = Annotated[int, Meta(ge=1)]
ObjectId = Annotated[str, Meta(min_length=1, max_length=128)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]
Metadata = dict[str, Any]  # strings: checked by the translation, which names the key at fault


class _Body(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class _Tagged(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag_field="type"):
    pass


# --- Responses ------------------------------------------------------------------------------------


class FunctionTool(_Tagged, tag="function", frozen=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Tagged, tag="function", frozen=True, kw_only=True):
    name: str


class TextFormat(_Tagged, tag="text", frozen=True, kw_only=True):
    pass


class JsonObjectFormat(_Tagged, tag="json_object", frozen=True, kw_only=True):
    pass


class JsonSchemaFormat(_Tagged, tag="json_schema", frozen=True, kw_only=True):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body, frozen=True, kw_only=True):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None


class ResponsesStreamOptions(_Body, frozen=True, kw_only=True):
    include_obfuscation: bool | None = None


class ClientOptions(_Body, frozen=True, kw_only=True):
    """What both routes take and keep with the task (``translation.with_client_options``)."""

    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: ServiceTier | None = None


class ConversationParam(_Body, frozen=True, kw_only=True):
    id: ObjectId


class ResponsesRequest(ClientOptions, frozen=True, kw_only=True):
    """Body of ``POST /v1/responses``."""

    model: Model
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    text: TextConfig | None = None
    previous_response_id: ObjectId | None = None
    conversation: ObjectId | ConversationParam | None = None  # api.openai.conversations
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # accepted only with the value that means what the service does
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


class InputTokensRequest(_Body, frozen=True, kw_only=True):
    """Body of ``POST /v1/responses/input_tokens``: what shapes a response's prompt, without the
    options of its generation. ``model`` is required: the count is the model's own tokenizer's."""

    model: Model
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    text: TextConfig | None = None
    previous_response_id: ObjectId | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None


# --- Chat Completions -----------------------------------------------------------------------------


class FunctionDefinition(_Body, frozen=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Tagged, tag="function", frozen=True, kw_only=True):
    function: FunctionDefinition


class ChatNamedFunction(_Body, frozen=True, kw_only=True):
    name: str


class ChatNamedTool(_Tagged, tag="function", frozen=True, kw_only=True):
    function: ChatNamedFunction


class ChatJsonSchema(_Body, frozen=True, kw_only=True):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ChatJsonSchemaFormat(_Tagged, tag="json_schema", frozen=True, kw_only=True):
    json_schema: ChatJsonSchema


class ChatStreamOptions(_Body, frozen=True, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ChatRequest(ClientOptions, frozen=True, kw_only=True):
    """Body of ``POST /v1/chat/completions``."""

    model: Model
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    stream: bool | None = None
    stream_options: ChatStreamOptions | None = None
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ChatNamedTool | None = None
    response_format: TextFormat | JsonObjectFormat | ChatJsonSchemaFormat | None = None
    # accepted only with the value that means what the service does
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    store: bool | None = None
    modalities: list[str] | None = None


# --- input items and chat messages (decoded one by one) -------------------------------------------


class _Item(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ContentPart(_Item, frozen=True, kw_only=True):
    """A part of an input message: ``input_text`` / ``output_text`` (other types are refused by type)."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None  # echoed back from an output_text part; must be empty
    logprobs: list[Any] | None = None


class MessageItem(_Item, frozen=True, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    id: ObjectId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Item, frozen=True, kw_only=True):
    type: Literal["function_call"]
    call_id: ObjectId
    name: str
    arguments: str
    id: ObjectId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Item, frozen=True, kw_only=True):
    type: Literal["function_call_output"]
    call_id: ObjectId
    output: str | list[dict[str, Any]]
    id: ObjectId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class SummaryPart(_Item, frozen=True, kw_only=True):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Item, frozen=True, kw_only=True):
    type: Literal["reasoning"]
    summary: list[SummaryPart]
    id: ObjectId | None = None
    content: list[Any] | None = None  # raw reasoning text: must be absent or empty
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ToolCallFunction(_Item, frozen=True, kw_only=True):
    name: str
    arguments: str


class ToolCall(_Item, frozen=True, kw_only=True):
    id: ObjectId
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Item, frozen=True, kw_only=True):
    """A chat message of any role; which fields a role allows is checked when it is translated."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: ObjectId | None = None
    reasoning_content: str | None = None  # a reasoning model's reasoning, sent back with its answer
    # echoed back from an assistant message this service returned: must be empty
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


encoder = msgspec.json.Encoder()
