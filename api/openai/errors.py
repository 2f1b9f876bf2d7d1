"""OpenAI's error object, which every error on the ``/v1`` routes is: ``{"error": {"message", "type",
"param", "code"}}``.

The status and the ``code`` are those of the problem document the LMSP routes would answer
(docs/protocol.md, "Errors"), so one table documents both; ``type`` is OpenAI's class of the
status; ``param`` names the request parameter at fault where there is one (``null`` otherwise).
``api.http.problems`` calls ``error_response`` for every error of a ``/v1`` path.
"""

import re
from collections.abc import Mapping
from typing import Any

import msgspec
from litestar import Response

from lmsp_core import wire
from lmsp_core.wire.errors import GenerationFailed, InvalidRequest, LmspError

MEDIA_TYPE = "application/json"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorObject(msgspec.Struct, frozen=True, kw_only=True):
    """The body of every error answer on ``/v1``."""

    error: ErrorBody


def error_type(status: int) -> str:
    """OpenAI's error class of a status: ``invalid_request_error`` for the other 4xx."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_object(problem: wire.Problem, param: str | None = None) -> ErrorObject:
    return ErrorObject(error=ErrorBody(message=problem.detail, type=error_type(problem.status), param=param,
                                       code=problem.code))


def error_response(problem: wire.Problem, headers: Mapping[str, str] | None = None,
                   param: str | None = None) -> Response[bytes]:
    return Response(content=msgspec.json.encode(error_object(problem, param)), status_code=problem.status,
                    media_type=MEDIA_TYPE, headers=dict(headers or {}))


class FailedGeneration(GenerationFailed):
    """The task failed: its problem, raised so that the /v1 error handler answers it."""

    def __init__(self, problem: wire.Problem) -> None:
        super().__init__(problem.detail, code=problem.code)
        self.stored = problem

    def problem(self) -> wire.Problem:
        return self.stored


def unsupported(param: str, message: str, *, value: bool = True) -> InvalidRequest:
    """A 400 for a parameter (``value=False``) or a value of a parameter that this service does not support."""
    return InvalidRequest(message, code=UNSUPPORTED_VALUE if value else UNSUPPORTED_PARAMETER,
                          extra={"param": param})


def param_of(exc: LmspError) -> str | None:
    param = exc.extra.get("param")
    return param if isinstance(param, str) else None


def with_param(exc: LmspError, params: Mapping[str, str]) -> LmspError:
    """Name the parameter of an error raised by the shared checks (``lmsp_core.requests.validation``, the
    catalog, extensions), from its code; ``params`` maps codes to the endpoint's parameter names."""
    if param_of(exc) is None:
        param = params.get(exc.code)
        if exc.code == "invalid_extension" and (param := _extension_param(exc)) is not None:
            # an OpenAI parameter carried as an extension: report it as the parameter it was
            exc.code = "invalid_request"
            exc.detail = f"Invalid value for {param!r}: {exc.detail.partition(': ')[2] or exc.detail}."
        if param is not None:
            exc.extra["param"] = param
    return exc


_EXTENSION_PARAMS = {"x-top_p": "top_p", "x-seed": "seed", "x-stop": "stop"}


def _extension_param(exc: LmspError) -> str | None:
    errors = exc.extra.get("errors") or [{}]
    key = str(errors[0].get("key", "")).removeprefix("extensions.")
    return _EXTENSION_PARAMS.get(key)


_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]*)`")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]*)`")


def join(prefix: str, path: str) -> str:
    """A parameter path: ``join("input[0]", ".content")`` is ``input[0].content``."""
    path = path.lstrip(".")
    if not prefix:
        return path
    return prefix + ("" if not path or path.startswith("[") else ".") + path


def validation_param(message: str, key: str | None) -> tuple[str | None, str, str]:
    """Parameter, code and message of a decoding error (msgspec's message, Litestar's key, where
    ``data`` stands for the whole body)."""
    key = "" if key in (None, "data") else str(key)
    if unknown := _UNKNOWN.search(message):
        param = join(key, unknown["field"])
        return param, UNSUPPORTED_PARAMETER, f"Unsupported parameter: {param!r} is not supported by this service."
    if missing := _MISSING.search(message):
        param = join(key, missing["field"])
        return param, "invalid_request", f"Missing required parameter: {param!r}."
    if not key:
        return None, "invalid_request", message
    if message.startswith("Invalid value") and (key == "type" or key.endswith(".type")):
        # a kind of object (a hosted tool, a format) that this service does not have
        return key, UNSUPPORTED_VALUE, f"Unsupported value for {key!r}: {message.removeprefix('Invalid value ')}."
    return key, "invalid_request", f"Invalid value for {key!r}: {message}."


async def errors_only(response: Response[Any]) -> Response[Any]:
    """``after_request`` of the ``/v1`` routes (in place of ``api.http.problems.problems_only``): an error
    a handler answers itself rather than raises becomes an OpenAI error object."""
    status = response.status_code
    if status is None or status < 400 or response.media_type == MEDIA_TYPE:
        return response
    code = "client_closed_request" if status == 499 else f"http_{status}"
    body = wire.Problem(type="", title="", status=status, detail="The request ended without an answer.", code=code)
    return error_response(body, {k: v for k, v in response.headers.items() if k.lower() != "content-type"})
