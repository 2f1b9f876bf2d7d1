"""The client's exceptions. A problem document (RFC 9457) from the service, or OpenAI's error object
from its ``/v1`` routes, becomes an ``APIStatusError`` subclass chosen by its HTTP status, carrying
the typed problem and its ``code`` (the same code either way).

    LmspClientError
    ├── APIConnectionError           the service could not be reached (or kept dropping a stream)
    ├── StreamError                  an ``error`` event ended a stream
    └── APIStatusError               a non-2xx answer
        ├── BadRequestError          400  (invalid_request, context_length_exceeded, invalid_cursor, ...)
        ├── AuthenticationError      401
        ├── PermissionDeniedError    403
        ├── NotFoundError            404  (model_not_found, task_not_found, ...)
        ├── ConflictError            409, 422  (idempotency_key_reused, ...)
        ├── EventHistoryExpired      410  (event_history_expired)
        ├── RateLimitError           429
        ├── ServiceUnavailableError  503  (service_unavailable, model_unavailable, ...)
        └── ServerError              other 5xx (generation_failed, worker_lost, ...)
"""

import httpx
import msgspec

from lmsp_core import wire


class LmspClientError(Exception):
    """Base class of everything the client raises."""


class APIConnectionError(LmspClientError):
    pass


class StreamError(LmspClientError):
    def __init__(self, problem: wire.Problem) -> None:
        super().__init__(f"{problem.code}: {problem.detail}")
        self.problem = problem
        self.code = problem.code


class APIStatusError(LmspClientError):
    """``param`` is the request parameter at fault, where an OpenAI error object names one."""

    def __init__(self, problem: wire.Problem, headers: httpx.Headers, param: str | None = None) -> None:
        super().__init__(f"{problem.status} {problem.code}: {problem.detail}")
        self.problem = problem
        self.status = problem.status
        self.code = problem.code
        self.param = param
        self.headers = headers

    @property
    def retry_after(self) -> float | None:
        value = self.headers.get("retry-after")
        try:
            return None if value is None else float(value)
        except ValueError:
            return None


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class EventHistoryExpired(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class ServiceUnavailableError(APIStatusError):
    pass


class ServerError(APIStatusError):
    pass


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    409: ConflictError, 410: EventHistoryExpired, 422: ConflictError, 429: RateLimitError,
    503: ServiceUnavailableError,
}


class _OpenAIErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str | None = None
    param: str | None = None
    code: str | None = None


class _OpenAIError(msgspec.Struct, frozen=True):
    """OpenAI's error object, the error answer of the ``/v1`` routes."""

    error: _OpenAIErrorBody


_BAD_BODY = (msgspec.DecodeError, msgspec.ValidationError)


def status_error(status: int, headers: httpx.Headers, body: bytes) -> APIStatusError:
    """The exception for a non-2xx answer; a body that is neither a problem document nor an OpenAI
    error object still gets one."""
    param = None
    try:
        problem = msgspec.json.decode(body, type=wire.Problem)
    except _BAD_BODY:
        try:
            problem, param = _from_openai(status, msgspec.json.decode(body, type=_OpenAIError).error)
        except _BAD_BODY:
            text = body.decode(errors="replace").strip()[:500] or "no body"
            problem = wire.Problem(type="about:blank", title="HTTP error", status=status, detail=text,
                                   code=f"http_{status}")
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else APIStatusError)
    return cls(problem, headers, param)


def _from_openai(status: int, error: _OpenAIErrorBody) -> tuple[wire.Problem, str | None]:
    problem = wire.Problem(type="about:blank", title=error.type or "HTTP error", status=status, detail=error.message,
                           code=error.code or f"http_{status}")
    return problem, error.param
