"""OpenAI's WebSocket mode of ``/v1/responses``, its messages and its memory: what a client's
``response.create`` asks for, the error envelope, and the per-connection cache of ``store: false``
responses (``api.follow.sockets`` runs a connection).

A ``response.create`` is the body of ``POST /v1/responses`` with ``"type"`` beside it; ``stream``
is implied (the answer is the response's events), ``background`` is a transport this mode does not
use and is refused when true, and ``generate: false`` (a warm-up without output) is refused too.
``stream_id`` is echoed on every message the create causes, so that a client can tell responses
apart; responses run one after another, in the order of their creates.

A ``store: false`` response is kept in the connection's memory only, as the whole conversation it
ended (without its instructions, which are never carried over): a later create on the same
connection continues it with ``previous_response_id`` and only its new input. Nothing else can see
it, and it is gone with the connection: after a reconnect its id is ``previous_response_not_found``.
"""

from collections import OrderedDict
from typing import Any, Literal

import msgspec

from api.openai import requests as rq
from api.openai.errors import ErrorBody, error_type, param_of
from api.openai.translation import EXTENSION, converted, echo_of
from lmsp_core import wire
from lmsp_core.store.objects.conversations import output_as_input
from lmsp_core.wire.errors import InvalidRequest, LmspError

CREATE = "response.create"
PREVIOUS_NOT_FOUND = "previous_response_not_found"
CACHED_RESPONSES = 64  # a connection's store:false responses that can be continued: the latest ones
_TRANSPORT = ("type", "stream", "stream_id", "generate")  # fields of the message, not of the request


class Create(msgspec.Struct, frozen=True, kw_only=True):
    """A decoded ``response.create``."""

    body: rq.ResponsesRequest
    stream_id: str | None = None


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An error that is no response's event, as OpenAI's WebSocket mode sends it (``stream_id``
    only where the create had one)."""

    type: Literal["error"]
    status: int
    error: ErrorBody
    stream_id: str | None = None


_envelope_encoder = msgspec.json.Encoder()


def stream_id_of(raw: str | bytes) -> str | None:
    """The ``stream_id`` of a message, if it has a readable one (for the envelope of its error)."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    chosen = value.get("stream_id") if isinstance(value, dict) else None
    return chosen if isinstance(chosen, str) else None


def decode_create(raw: str | bytes) -> Create:
    """A client's message as a ``response.create``; anything else is a 400 naming what is wrong."""
    try:
        value: Any = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise InvalidRequest("The message is not JSON: send {\"type\": \"response.create\", ...}.") from None
    if not isinstance(value, dict):
        raise InvalidRequest("The message is not a JSON object: send {\"type\": \"response.create\", ...}.")
    kind = value.get("type")
    if kind != CREATE:
        raise InvalidRequest(f"Unsupported message type {kind!r}: this socket takes {CREATE!r}.",
                             code="unsupported_value", extra={"param": "type"})
    if value.get("generate") is False:
        raise InvalidRequest("generate: false (a warm-up without output) is not supported.",
                             code="unsupported_value", extra={"param": "generate"})
    if value.get("background"):
        raise InvalidRequest("background is not used in WebSocket mode: the response streams on this socket. "
                             "Use POST /v1/responses for a background response.", code="unsupported_value",
                             extra={"param": "background"})
    stream_id = value.get("stream_id")
    if stream_id is not None and not isinstance(stream_id, str):
        raise InvalidRequest("stream_id must be a string.", extra={"param": "stream_id"})
    fields = {name: field for name, field in value.items() if name not in _TRANSPORT}
    body = converted({**fields, "stream": True}, rq.ResponsesRequest, "")
    return Create(body=body, stream_id=stream_id)


def envelope(exc: LmspError, stream_id: str | None = None) -> bytes:
    """The error envelope of a message the service refused: the status and code of the HTTP route's
    error, but for an unknown ``previous_response_id``, which is OpenAI's ``400
    previous_response_not_found`` here (a client's cue to send the whole conversation again)."""
    problem, param = exc.problem(), param_of(exc)
    status, code = problem.status, problem.code
    if code == "response_not_found" and param == "previous_response_id":
        status, code = 400, PREVIOUS_NOT_FOUND
    body = ErrorBody(message=problem.detail, type=error_type(status), param=param, code=code)
    return _envelope_encoder.encode(ErrorEnvelope(type="error", status=status, error=body, stream_id=stream_id))


class ConnectionCache:
    """The continuable ``store: false`` responses of one connection: each one's conversation, its
    output included, the latest ``CACHED_RESPONSES`` of them."""

    def __init__(self, size: int = CACHED_RESPONSES) -> None:
        self.size = size
        self._conversations: OrderedDict[str, list[wire.InputItem]] = OrderedDict()

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._conversations

    def continued(self, request: wire.ResponseRequest) -> wire.ResponseRequest:
        """``request`` with the conversation of its ``previous_response_id``, a response of this
        connection, before its new input (after its instructions), and that id kept for the echo."""
        assert request.previous_response_id is not None
        earlier = self._conversations[request.previous_response_id]
        self._conversations.move_to_end(request.previous_response_id)
        head, new = _split_instructions(request)
        echo = {**echo_of(request), "previous_response_id": request.previous_response_id}
        return msgspec.structs.replace(request, input=[*head, *earlier, *new], previous_response_id=None,
                                       extensions={**(request.extensions or {}), EXTENSION: echo})

    def keep(self, response_id: str, request: wire.ResponseRequest, earlier: list[wire.InputItem],
             response: wire.Response) -> None:
        """Remember a final ``store: false`` response: ``earlier`` (the stored turns its request
        continued, if any), its input without instructions, its output."""
        _, new = _split_instructions(request)
        self._conversations[response_id] = [*earlier, *new, *(output_as_input(item) for item in response.output)]
        while len(self._conversations) > self.size:
            self._conversations.popitem(last=False)


def _split_instructions(request: wire.ResponseRequest) -> tuple[list[wire.InputItem], list[wire.InputItem]]:
    """The system message ``instructions`` became (if any), and the rest of the input."""
    count = 1 if echo_of(request).get("instructions") else 0
    return list(request.input[:count]), list(request.input[count:])
