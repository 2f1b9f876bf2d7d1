"""Chat completions and their chunks as ``/v1/chat/completions`` answers them, in OpenAI's shapes: every
field these types declare is always sent (``null`` included) unless a type omits its defaults, as
OpenAI does; the tests validate them with the ``openai`` package's own models."""

from typing import Literal

import msgspec
from msgspec import Struct

from api.openai.objects import ServiceTier
from lmsp_core.wire import TokenLogprob


class _Obj(Struct, frozen=True, kw_only=True):
    pass


class ToolCallFunction(_Obj, frozen=True, kw_only=True):
    name: str
    arguments: str


class ToolCall(_Obj, frozen=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Obj, frozen=True, kw_only=True, omit_defaults=True):
    """``tool_calls`` and ``reasoning_content`` are left out when there are none."""

    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCall] | None = None
    # the text of a reasoning model's reasoning section (the convention of DeepSeek and vLLM)
    reasoning_content: str | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChoiceLogprobs(_Obj, frozen=True, kw_only=True):
    """The log-probabilities of a choice's (or a chunk's) content tokens, where ``logprobs: true`` asked."""

    content: list[TokenLogprob] | None
    refusal: None = None


class Choice(_Obj, frozen=True, kw_only=True):
    index: int = 0
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(_Obj, frozen=True, kw_only=True):
    cached_tokens: int = 0


class CompletionUsage(_Obj, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class ChatCompletion(_Obj, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage | None
    system_fingerprint: None = None
    service_tier: ServiceTier = "default"
    metadata: dict[str, str] | None = None


class ToolCallDelta(_Obj, frozen=True, kw_only=True):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Delta(_Obj, frozen=True, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    # null (rather than left out) in the first chunk of an answer that is not text, as OpenAI sends it
    content: str | msgspec.UnsetType | None = msgspec.UNSET
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Obj, frozen=True, kw_only=True):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Obj, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: None = None
    service_tier: ServiceTier = "default"
    usage: CompletionUsage | None = None
