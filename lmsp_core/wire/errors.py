"""The service's exceptions: a small hierarchy, one class per HTTP status family.

Every error carries a stable ``code`` (the ``code`` member of a problem document) and knows the
problem object (RFC 9457) that describes it. Workers put that object into ``response.failed``
events; only the API turns errors into HTTP responses.

    LmspError
    ├── InvalidRequest          400  invalid_request, unsupported_version, unsupported_content_type, ...
    │   ├── UnsupportedCapability   400  unsupported_capability
    │   ├── ContextLengthExceeded   400  context_length_exceeded
    │   └── LimitExceeded           400  too_many_input_items, too_many_tools, input_too_long
    ├── Unauthorized            401  unauthorized, invalid_token (with WWW-Authenticate: Bearer)
    ├── Forbidden               403  insufficient_scope
    ├── NotFound                404  not_found, model_not_found, task_not_found, response_not_found
    ├── Gone                    410  event_history_expired
    ├── ContentTooLarge         413  file_too_large
    ├── Unprocessable           422  idempotency_key_reused
    ├── TooManyRequests         429  rate_limited, too_many_streams (with Retry-After)
    ├── ServiceUnavailable      503  service_unavailable, model_unavailable, server_busy
    └── GenerationFailed        500  generation_failed, worker_lost, generation_timeout
"""

from typing import Any, ClassVar

from lmsp_core.wire.responses import Problem

PROBLEM_TYPE_PREFIX = "urn:lmsp:problem:"
PROBLEM_MEDIA_TYPE = "application/problem+json"  # RFC 9457: every LMSP error body


class LmspError(Exception):
    """Base class. Subclasses set the HTTP status, a default code and a title."""

    status: ClassVar[int] = 500
    default_code: ClassVar[str] = "internal_error"
    title: ClassVar[str] = "Internal error"

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code or self.default_code
        self.headers = headers or {}
        self.extra = extra or {}

    def problem(self) -> Problem:
        return problem(self.status, self.code, self.title, self.detail, self.extra)


def problem(status: int, code: str, title: str, detail: str, extra: dict[str, Any] | None = None) -> Problem:
    return Problem(
        type=PROBLEM_TYPE_PREFIX + code,
        title=title,
        status=status,
        detail=detail,
        code=code,
        errors=(extra or {}).get("errors"),
    )


class InvalidRequest(LmspError):
    status = 400
    default_code = "invalid_request"
    title = "Invalid request"


class UnsupportedCapability(InvalidRequest):
    default_code = "unsupported_capability"
    title = "Unsupported capability"


class ContextLengthExceeded(InvalidRequest):
    default_code = "context_length_exceeded"
    title = "Context length exceeded"


class LimitExceeded(InvalidRequest):
    default_code = "limit_exceeded"
    title = "Limit exceeded"


class Unauthorized(LmspError):
    status = 401
    default_code = "unauthorized"
    title = "Unauthorized"

    def __init__(self, detail: str, *, code: str | None = None) -> None:
        # RFC 6750 3: a missing token gets the bare challenge, a bad one says invalid_token
        challenge = 'Bearer realm="lmsp"' + (f', error="{code}"' if code else "")
        super().__init__(detail, code=code, headers={"WWW-Authenticate": challenge})


class Forbidden(LmspError):
    status = 403
    default_code = "insufficient_scope"
    title = "Insufficient scope"

    def __init__(self, detail: str, *, scope: str) -> None:
        super().__init__(detail, headers={
            "WWW-Authenticate": f'Bearer realm="lmsp", error="insufficient_scope", scope="{scope}"'})


class NotFound(LmspError):
    status = 404
    default_code = "not_found"
    title = "Not found"


class Gone(LmspError):
    status = 410
    default_code = "event_history_expired"
    title = "Event history expired"


class ContentTooLarge(LmspError):
    status = 413
    default_code = "file_too_large"
    title = "Content too large"


class Unprocessable(LmspError):
    status = 422
    default_code = "unprocessable"
    title = "Unprocessable request"


class TooManyRequests(LmspError):
    status = 429
    default_code = "rate_limited"
    title = "Too many requests"

    def __init__(self, detail: str, *, retry_after: int, code: str | None = None) -> None:
        super().__init__(detail, code=code, headers={"Retry-After": str(max(1, retry_after))})


class ServiceUnavailable(LmspError):
    status = 503
    default_code = "service_unavailable"
    title = "Service unavailable"

    def __init__(self, detail: str, *, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(detail, code=code, headers={"Retry-After": str(retry_after)})


class GenerationFailed(LmspError):
    status = 500
    default_code = "generation_failed"
    title = "Generation failed"
