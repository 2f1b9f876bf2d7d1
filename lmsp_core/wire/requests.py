"""LMSP 1.0 requests (6.1): input items and their content parts, the request's options, and
``ResponseRequest``. Requests are strict: unknown fields are rejected and constraints are declared
with ``Meta`` so that the API validates them while decoding."""

import functools
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from lmsp_core.wire.extensions import ExtensionMap, Extensions
from lmsp_core.wire.extensions import parse as parse_extensions

# Size limits (input items, content parts, tools, text length) are settings, checked after decoding
# by ``validation.check_limits`` so that each has its own problem code; the body size caps decoding.

Text = str
# input items accept an output item's ``status`` (and ignore it), so that output items can be sent
# back as they were returned
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

class ResponseRequest(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, dict=True):
    """Body of ``POST /lmsp/v1/responses`` and ``POST /lmsp/v1/tasks`` (6.1). (``dict``: room for
    ``known_extensions``, decoded once per request.)"""

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

    @functools.cached_property
    def known_extensions(self) -> Extensions:
        """The known extensions, decoded once (admission checks them first: ``400 invalid_extension``)."""
        return parse_extensions(self.extensions)
