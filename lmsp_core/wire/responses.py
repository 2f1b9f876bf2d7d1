"""LMSP 1.0 responses (6.2): the response object, its output items, usage, and the problem
object of a failure. Output types always encode every field (``null`` included), as the spec's
examples show."""

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

# an output item's ``status`` is there only on an item that a failure cut short ("incomplete")
ItemStatus = Literal["incomplete"]


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
