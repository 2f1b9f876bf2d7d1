"""OpenAI's Batch API, its objects and its lines: what a line of an input file asks for, and the
output and error lines a batch writes (docs/protocol.md, "Batches").

A line is ``{"custom_id": ..., "method": "POST", "url": <the batch's endpoint>, "body": {...}}``;
its body is the body of that endpoint, checked and translated as the endpoint would
(``translation``). An output line is ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}``, the body what the endpoint would have answered; a line that could not
run gets an error line: ``response`` with the endpoint's error answer (the request was refused, or
failed), or ``response: null`` and ``error: {code, message}`` (the line itself is malformed, or the
batch was cancelled or expired before it ran).
"""

import re
from typing import Any, Literal, NamedTuple

import msgspec
from msgspec import Struct

from api.openai import requests as rq
from api.openai.chat import completion
from api.openai.chattranslation import chat_request
from api.openai.errors import error_object
from api.openai.rendering import ResponseView, response_object
from api.openai.translation import responses_request
from lmsp_core import wire
from lmsp_core.requests.catalog import Catalog
from lmsp_core.store.objects.batches import BatchRecord
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest

ENDPOINTS = ("/v1/chat/completions", "/v1/responses")
WINDOW = re.compile(r"^([1-9][0-9]{0,4})([smh])$")
MAX_WINDOW = 24 * 3600.0
# the windows window_seconds accepts, for the OpenAPI document: a whole number (no leading zero) of
# seconds, minutes or hours, from 1 s to 24 h
WINDOW_PATTERN = (r"^(([1-9][0-9]{0,3}|[1-7][0-9]{4}|8[0-5][0-9]{3}|86[0-3][0-9]{2}|86400)s"
                  r"|([1-9][0-9]{0,2}|1[0-3][0-9]{2}|14[0-3][0-9]|1440)m|([1-9]|1[0-9]|2[0-4])h)$")
_UNITS = {"s": 1, "m": 60, "h": 3600}


class BatchCreate(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # OpenAI's; output files here live LMSP_FILE_RETENTION


class RequestCounts(Struct, frozen=True, kw_only=True):
    total: int
    completed: int
    failed: int


class BatchError(Struct, frozen=True, kw_only=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


def window_seconds(window: str) -> float:
    """``24h`` (OpenAI's only value) or a shorter window such as ``30m`` or ``90s``."""
    match = WINDOW.fullmatch(window)
    seconds = int(match.group(1)) * _UNITS[match.group(2)] if match else 0
    if not 0 < seconds <= MAX_WINDOW:
        raise InvalidRequest("completion_window must be '24h' or a shorter duration such as '1h', '30m' or '90s'.",
                             code="unsupported_value", extra={"param": "completion_window"})
    return float(seconds)


def batch_object(record: BatchRecord) -> Batch:
    def at(value: float | None) -> int | None:
        return None if value is None else int(value)

    errors = msgspec.json.decode(record.errors, type=BatchErrors) if record.errors else None
    metadata = msgspec.json.decode(record.metadata, type=dict[str, str]) if record.metadata else None
    return Batch(id=record.id, endpoint=record.endpoint, errors=errors, input_file_id=record.input_file_id,
                 completion_window=record.completion_window, status=record.status,
                 output_file_id=record.output_file_id, error_file_id=record.error_file_id,
                 created_at=int(record.created_at), in_progress_at=at(record.in_progress_at),
                 expires_at=at(record.expires_at), finalizing_at=at(record.finalizing_at),
                 completed_at=at(record.completed_at), failed_at=at(record.failed_at),
                 expired_at=at(record.expired_at), cancelling_at=at(record.cancelling_at),
                 cancelled_at=at(record.cancelled_at),
                 request_counts=RequestCounts(total=record.total, completed=record.completed, failed=record.failed),
                 metadata=metadata)


# --- lines ----------------------------------------------------------------------------------------


class Line(NamedTuple):
    custom_id: str
    body: dict[str, Any]


class LineError(Exception):
    """A line that is not a request of the batch: it ends in the error file as it is."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


class _RawLine(Struct, frozen=True):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def parse_line(raw: bytes, endpoint: str) -> Line:
    """A line of the input file, as a request of ``endpoint``; raises ``LineError``."""
    try:
        line = msgspec.json.decode(raw, type=_RawLine)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        custom_id = _custom_id_of(raw)
        raise LineError("invalid_request", f"The line is not a batch request: {exc}", custom_id) from None
    if line.method != "POST":
        raise LineError("invalid_method", f"method must be POST, not {line.method!r}.", line.custom_id)
    if line.url != endpoint:
        raise LineError("invalid_url", f"url must be the batch's endpoint {endpoint!r}, not {line.url!r}.",
                        line.custom_id)
    if line.body.get("stream"):
        raise LineError("invalid_request", "A batch request cannot be streamed (stream: true).", line.custom_id)
    return Line(line.custom_id, line.body)


def _custom_id_of(raw: bytes) -> str | None:
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def lmsp_request(line: Line, endpoint: str, catalog: Catalog) -> wire.ResponseRequest:
    """The line's body as the LMSP request its endpoint would make of it, queued at ``low``
    priority (interactive requests of the same owner come first); raises ``LmspError``."""
    try:
        if endpoint == "/v1/responses":
            body = msgspec.convert(line.body, rq.ResponsesRequest)
            request = responses_request(msgspec.structs.replace(body, background=None), catalog.get(body.model))
        else:
            chat = msgspec.convert(line.body, rq.ChatRequest)
            request = chat_request(chat, catalog.get(chat.model))
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc)) from None
    extensions = {**(request.extensions or {}), "x-priority": "low"}
    return msgspec.structs.replace(request, extensions=extensions)


def request_id(batch_id: str, line: int) -> str:
    return ids.derived_id("batch_req", f"{batch_id}:{line}")


def output_line(batch_id: str, line: int, custom_id: str, record: TaskRecord, endpoint: str) -> tuple[bytes, bool]:
    """The line of a task that ended, and whether it belongs in the output file (else the error file)."""
    final = record.response_object()
    if final is not None and final.status == "failed":
        problem = final.error or wire.Problem(type="about:blank", title="Generation failed", status=500,
                                              detail="The model failed while generating.", code="generation_failed")
        return refused_line(batch_id, line, custom_id, problem, record.id), False
    if endpoint == "/v1/responses":
        body: Any = response_object(ResponseView(record))
    else:
        body = completion(record)
    response = {"status_code": 200, "request_id": record.id, "body": msgspec.to_builtins(body)}
    return _encode(batch_id, line, custom_id, response, None), True


def refused_line(batch_id: str, line: int, custom_id: str, problem: wire.Problem, task_id: str | None = None) -> bytes:
    """The error line of a request the endpoint refused or that failed: its error answer."""
    body = msgspec.to_builtins(error_object(problem))
    response = {"status_code": problem.status, "request_id": task_id, "body": body}
    return _encode(batch_id, line, custom_id, response, None)


def error_line(batch_id: str, line: int, custom_id: str | None, code: str, message: str) -> bytes:
    """The error line of a line that never ran."""
    return _encode(batch_id, line, custom_id, None, {"code": code, "message": message})


def _encode(batch_id: str, line: int, custom_id: str | None, response: dict[str, Any] | None,
            error: dict[str, str] | None) -> bytes:
    return msgspec.json.encode({"id": request_id(batch_id, line), "custom_id": custom_id, "response": response,
                                "error": error})
