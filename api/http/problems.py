"""Every error the API answers is an RFC 9457 problem document with a stable ``code`` (on the OpenAI
routes under ``/v1``: OpenAI's error object with the same status and code, ``api.openai.errors``).

The handlers here are the only place where exceptions become HTTP responses: the service's own
errors (``lmsp_core.wire.errors``), Litestar's (validation, unknown route, wrong method, body too
large), Redis being unreachable, and anything unexpected (a 500 with no traceback in the body).
``problems_only`` catches the error responses that handlers return instead of raising.
"""

import logging
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from redis.exceptions import RedisError

from api.openai import errors as openai_errors
from api.openai import is_openai_path
from lmsp_core import wire
from lmsp_core.wire.errors import PROBLEM_MEDIA_TYPE, LmspError, ServiceUnavailable, problem

logger = logging.getLogger(__name__)

# codes for errors that Litestar raises itself
_STATUS_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "unprocessable",
    429: "rate_limited",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable",
}


def problem_response(body: wire.Problem, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(content=msgspec.json.encode(body), status_code=body.status, media_type=PROBLEM_MEDIA_TYPE,
                    headers=headers or {})


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _answer(request: Request[Any, Any, Any], body: wire.Problem, headers: dict[str, str] | None = None,
            param: str | None = None) -> Response[bytes]:
    if is_openai_path(request.url.path):
        return openai_errors.error_response(body, headers, param)
    return problem_response(body, headers)


def lmsp_error(request: Request[Any, Any, Any], exc: LmspError) -> Response[bytes]:
    return _answer(request, exc.problem(), exc.headers, openai_errors.param_of(exc))


def validation_error(request: Request[Any, Any, Any], exc: ValidationException) -> Response[bytes]:
    errors = exc.extra if isinstance(exc.extra, list) else None
    detail = "; ".join(str(e.get("message", e)) for e in errors if isinstance(e, dict)) if errors else exc.detail
    if errors and isinstance(errors[0], dict) and is_openai_path(request.url.path):
        param, code, message = openai_errors.validation_param(str(errors[0].get("message", "")), errors[0].get("key"))
        return _answer(request, problem(400, code, "Invalid request", message), param=param)
    body = problem(400, "invalid_request", "Invalid request", detail or "The request is not valid.",
                   {"errors": errors} if errors else None)
    return _answer(request, body)


def http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    code = _STATUS_CODES.get(status, f"http_{status}")
    detail = exc.detail if exc.detail and exc.detail != _phrase(status) else f"{_phrase(status)}."
    headers = dict(exc.headers or {})
    return _answer(request, problem(status, code, _phrase(status), detail), headers)


def redis_error(request: Request[Any, Any, Any], exc: RedisError) -> Response[bytes]:
    logger.warning("Redis unavailable: %s", type(exc).__name__)
    error = ServiceUnavailable("The service's store is unreachable; retry shortly.", retry_after=2)
    return _answer(request, error.problem(), error.headers)


def internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    logger.exception("unhandled error", exc_info=exc)
    return _answer(request, problem(500, "internal_error", "Internal error", "The service failed unexpectedly."))


async def problems_only(response: Response[Any]) -> Response[Any]:
    """App-wide ``after_request`` hook: an error a handler answers itself rather than raises (such
    as Litestar's HTML 404 page under /schema) becomes a problem document too."""
    status = response.status_code
    if status is None or status < 400 or response.media_type == PROBLEM_MEDIA_TYPE:  # None: the handler's default
        return response
    body = problem(status, _STATUS_CODES.get(status, f"http_{status}"), _phrase(status), f"{_phrase(status)}.")
    return problem_response(body, {k: v for k, v in response.headers.items() if k.lower() != "content-type"})


HANDLERS: dict[type[Exception] | int, Any] = {
    LmspError: lmsp_error,
    ValidationException: validation_error,
    HTTPException: http_error,
    RedisError: redis_error,
    Exception: internal_error,
}
