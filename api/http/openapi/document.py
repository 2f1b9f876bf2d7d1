"""OpenAPI documentation of the routes: request and response examples, problem documents.

Examples are built from the wire Structs themselves, so a change to a wire type that breaks an
example fails at import (and in the schema test) instead of documenting something untrue.
"""

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Router
from litestar.datastructures import ResponseHeader
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example, Tag

from api.http.openapi import eventstreams as streamdoc
from api.http.strictbodies import StructDoc
from lmsp_core import wire
from lmsp_core.requests import webhooks as webhook_checks
from lmsp_core.store.tasks.records import ListCursor
from lmsp_core.wire import extensions, webhooks
from lmsp_core.wire.errors import PROBLEM_MEDIA_TYPE, problem

TASK_ID = "task_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
RESPONSE_ID = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
MESSAGE_ID = "msg_01J8M6Q4W5C8H2K9P3S7Y1A6ZE"
MODEL = "smollm2:135m-instruct"
TEXT = "A local model service is a resident interface layer."


def _value(struct: Any) -> Any:
    return msgspec.to_builtins(struct)


@dataclass
class LiteralExample(Example):
    """An example whose value goes into the document as it is. Litestar 2.25 drops ``null`` members
    from example values (our objects always carry them) and copies ``id`` into the example object
    (which OpenAPI forbids); ``id`` only names the example here."""

    def to_schema(self) -> dict[str, Any]:
        fields = {"summary": self.summary, "description": self.description, "value": self.value}
        return {name: value for name, value in fields.items() if value is not None}


def example(summary: str, struct: Any, example_id: str | None = None) -> Example:
    return LiteralExample(id=example_id, summary=summary, value=_value(struct))


def _user(text: str) -> list[wire.InputItem]:
    return [wire.Message(role="user", content=[wire.InputText(text=text)])]


REQUEST = wire.ResponseRequest(model=MODEL, input=_user("Describe a local model service in one sentence."),
                               max_output_tokens=64)
REQUEST_EXAMPLES = [
    example("A short answer", REQUEST),
    example("Streamed, sampled", wire.ResponseRequest(
        model=MODEL, input=[wire.Message(role="system", content=[wire.InputText(text="Answer briefly.")]),
                            *_user("Write a haiku about queues.")],
        stream=True, temperature=0.7, max_output_tokens=48)),
    example("With extensions (docs/protocol.md, Extensions)", wire.ResponseRequest(
        model=MODEL, input=_user("List three colours."), temperature=1.0, max_output_tokens=48,
        extensions={"x-seed": 42, "x-top_p": 0.9, "x-stop": ["\n\n"], "x-priority": "low"})),
]

USAGE = wire.Usage(input_tokens=28, output_tokens=12, total_tokens=40)
RESPONSE = wire.Response(
    id=RESPONSE_ID, created_at=1794200000, status="completed", model=MODEL,
    output=[wire.OutputMessage(id=MESSAGE_ID, content=[wire.OutputTextPart(text=TEXT)])], usage=USAGE,
)
QUEUED_TASK = wire.Task(id=TASK_ID, status="queued", created_at=1794200000, model=MODEL, response_id=RESPONSE_ID)
FINAL_TASK = wire.Task(id=TASK_ID, status="completed", created_at=1794200000, started_at=1794200001,
                       finished_at=1794200003, model=MODEL, response_id=RESPONSE_ID, response=RESPONSE)
MODEL_OBJECT = wire.ModelObject(id=MODEL, context_window=8192, max_output_tokens=4096, capabilities=["streaming"],
                                status="available", workers=1)

_EVENTS: list[tuple[int | None, str, Any]] = [
    (1, wire.CREATED, wire.ResponseCreated(response_id=RESPONSE_ID)),
    (2, wire.ITEM_ADDED, wire.OutputItemAdded(response_id=RESPONSE_ID, output_index=0,
                                              item=wire.OutputMessage(id=MESSAGE_ID))),
    (3, wire.TEXT_DELTA, wire.OutputTextDelta(response_id=RESPONSE_ID, item_id=MESSAGE_ID, delta=TEXT)),
    (4, wire.ITEM_DONE, wire.OutputItemDone(response_id=RESPONSE_ID, output_index=0, item=RESPONSE.output[0])),
    (5, wire.COMPLETED, wire.ResponseCompleted(response_id=RESPONSE_ID, status="completed", usage=USAGE)),
]


def _sse(events: list[tuple[int | None, str, Any]]) -> str:
    blocks = []
    for event_id, name, data in events:
        head = "" if event_id is None else f"id: {event_id}\n"
        blocks.append(f"{head}event: {name}\ndata: {wire.encoder.encode(data).decode()}\n")
    return "\n".join(blocks)


EVENT_STREAM = _sse(_EVENTS)
# the queue position of a waiting task is a comment line (an event only with ?queue_events=true)
TASK_EVENT_STREAM = ": queued 2\n\n" + _sse(_EVENTS)

# each event of a response's stream (6.3) and the type of its data
_RESPONSE_EVENTS: dict[str, Any] = {
    wire.CREATED: wire.ResponseCreated, wire.ITEM_ADDED: wire.OutputItemAdded, wire.TEXT_DELTA: wire.OutputTextDelta,
    wire.REASONING_DELTA: wire.ReasoningSummaryTextDelta, wire.ITEM_DONE: wire.OutputItemDone,
    wire.COMPLETED: wire.ResponseCompleted, wire.INCOMPLETE: wire.ResponseIncomplete, wire.FAILED: wire.ResponseFailed,
    wire.CANCELLED: wire.ResponseCancelled,
    wire.ERROR: wire.ErrorEventData,  # no id: the store went away, the client resumes after the last id
}
RESPONSE_EVENTS = streamdoc.event_schema({name: streamdoc.json_data(kind) for name, kind in _RESPONSE_EVENTS.items()},
                                         numbered=True)
TASK_EVENTS = streamdoc.event_schema({name: streamdoc.json_data(kind) for name, kind in
                                      {**_RESPONSE_EVENTS, wire.QUEUED: wire.TaskQueued}.items()}, numbered=True)

# Parameters the handlers check themselves (with their own problem codes), documented with the same
# constraints, so that every value the schema allows is accepted. An event number; empty: none (from
# the start). Up to 18 digits: each such number is a valid cursor.
EVENT_CURSOR: dict[str, Any] = {"type": "string", "pattern": "^[0-9]{0,18}$",
                                "description": "the number of the last event received"}
# `next_cursor` of the previous page; empty: the first page (schema_extra of a Litestar parameter)
LIST_CURSOR: dict[str, Any] = {"type": "string", "oneOf": None, "pattern": f"^({ListCursor.PATTERN})?$"}

_PROBLEMS: dict[str, tuple[int, str, str]] = {
    "invalid_request": (400, "Invalid request", "Object missing required field `model` - at `$`"),
    "invalid_extension": (400, "Invalid request", "Extension 'x-seed': Expected `int` >= 0"),
    "invalid_cursor": (400, "Invalid request", "Event cursor 'abc' is not a non-negative integer."),
    "context_length_exceeded": (400, "Context length exceeded",
                                "The prompt (9000 tokens) does not fit the context window of 8192 tokens."),
    "unsupported_capability": (400, "Unsupported capability", f"Model {MODEL!r} does not support tools."),
    "unsupported_content_type": (400, "Invalid request", "Content of type 'input_image' is not supported: model "
                                                         f"{MODEL!r} takes text only."),
    "max_output_tokens_too_large": (400, "Invalid request", f"max_output_tokens is 9000; model {MODEL!r} allows at "
                                                            "most 4096."),
    "max_output_tokens_too_small": (400, "Invalid request", "max_output_tokens is 4; the shortest complete output of "
                                                            "this request (its tool call) takes 9 tokens with model "
                                                            f"{MODEL!r}."),
    "too_many_input_items": (400, "Limit exceeded", "input has 2000 items; at most 1000 are allowed."),
    "too_many_tools": (400, "Limit exceeded", "The request has 200 tools; at most 128 are allowed."),
    "input_too_long": (400, "Limit exceeded", "The input has 2000000 characters of text; at most 1000000 are "
                                              "allowed."),
    "unknown_tool": (400, "Invalid request", "tool_choice names 'get_time', which is not among the tools."),
    "invalid_tool_choice": (400, "Invalid request", "tool_choice 'required' needs at least one tool."),
    "duplicate_tool_name": (400, "Invalid request", "Two tools are named 'get_weather'."),
    "unmatched_call_id": (400, "Invalid request", "The function_call_output's call_id 'call_1' matches no earlier "
                                                  "function_call."),
    "invalid_tool_schema": (400, "Invalid request", "The parameters of tool 'get_weather' are not a JSON Schema the "
                                                    "grammar engine can enforce."),
    "invalid_json_schema": (400, "Invalid request", "The response format's schema cannot be enforced."),
    "invalid_idempotency_key": (400, "Invalid request", "Idempotency-Key must be 1-255 visible ASCII characters."),
    "previous_response_in_progress": (400, "Invalid request", f"Response {RESPONSE_ID!r} is not final."),
    "conversation_too_long": (400, "Invalid request", "The conversation has more than 1000 stored turns."),
    "model_not_found": (404, "Not found", "Model 'no-such-model' does not exist."),
    "task_not_found": (404, "Not found", f"Task {TASK_ID!r} does not exist."),
    "response_not_found": (404, "Not found", "Response 'resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF' does not exist (or was "
                                             "not stored, or has expired)."),
    "event_history_expired": (410, "Event history expired",
                              f"The events of task {TASK_ID} have expired; GET /lmsp/v1/tasks/{TASK_ID} still "
                              "returns its result."),
    "generation_failed": (500, "Generation failed", "The model failed while generating."),
    "service_unavailable": (503, "Service unavailable", "The service's store is unreachable; retry shortly."),
    "model_unavailable": (503, "Service unavailable", f"No worker is running model {MODEL!r} right now."),
    "server_busy": (503, "Service unavailable", f"The queue of model {MODEL!r} is full (1000 tasks); retry later."),
    "not_ready": (503, "Service unavailable", "Not ready: no worker is alive."),
    "unauthorized": (401, "Unauthorized", "This route needs a bearer token (Authorization: Bearer <token>)."),
    "insufficient_scope": (403, "Forbidden", "This route needs the scope 'tasks:write'."),
    "idempotency_key_reused": (422, "Unprocessable Content",
                               "This Idempotency-Key was used with another request body."),
    "rate_limited": (429, "Too Many Requests", "Too many requests; retry after the time in Retry-After."),
    "too_many_streams": (429, "Too Many Requests", "This principal already has 32 open streams; close one or retry "
                                                   "later."),
    "queue_quota_exceeded": (429, "Too Many Requests", f"Principal 'acme' already has 1000 tasks waiting for model "
                                                       f"{MODEL!r} (its max_queued); retry once some have started."),
    "webhook_not_found": (404, "Not found", "Webhook endpoint 'wh_01J8M6Q4W2T7N5R3V9X1Z8B0DF' does not exist."),
    "invalid_webhook_url": (400, "Invalid request", "The webhook URL 'ftp://receiver.example/' is not an http or "
                                                    "https URL."),
    "webhook_url_unresolved": (400, "Invalid request", "The webhook URL's host 'receiver.example' does not resolve."),
    "webhook_url_not_allowed": (400, "Invalid request", "The webhook URL's host resolves to a private address, "
                                                        "which this service does not send to."),
    "unknown_event_type": (400, "Invalid request", "Unknown event type 'response.done'; the types are "
                                                   "response.completed, ..."),
    "too_many_webhooks": (400, "Limit exceeded", "Principal 'acme' already has 32 webhook endpoints; delete one "
                                                 "first."),
}
# what the LMSP request body's types alone do not say (api.http.strictbodies)
BODIES: dict[type, StructDoc] = {
    wire.ResponseRequest: StructDoc(fields={"extensions": {"anyOf": [extensions.json_schema(), {"type": "null"}]}}),
    webhooks.WebhookCreate: StructDoc(fields={"url": {
        "type": "string", "maxLength": webhooks.MAX_URL_LENGTH, "pattern": webhook_checks.URL_PATTERN,
        "description": "an http(s) URL of visible ASCII characters, without credentials or a fragment; its host "
                       "must resolve to global addresses"}, "events": {
        "type": "array", "items": {"enum": list(webhooks.EVENT_TYPES)}, "minItems": 1,
        "maxItems": len(webhooks.EVENT_TYPES), "description": "the event types to send (a repeat counts once)"}}),
}

# what every route with a scope may answer: no or a bad token, a token without the scope, the rate limit
GUARDED = ("unauthorized", "insufficient_scope", "rate_limited")
# what a request to generate may be refused for (the response it continues: response_not_found)
SUBMISSION = ("invalid_request", "invalid_extension", "invalid_idempotency_key", "unsupported_capability",
              "unsupported_content_type", "context_length_exceeded", "max_output_tokens_too_large",
              "max_output_tokens_too_small", "too_many_input_items", "too_many_tools", "input_too_long",
              "unknown_tool", "invalid_tool_choice", "duplicate_tool_name", "unmatched_call_id", "invalid_tool_schema",
              "invalid_json_schema", "previous_response_in_progress", "conversation_too_long", "model_not_found",
              "response_not_found", "idempotency_key_reused", "service_unavailable", "model_unavailable",
              "server_busy", "queue_quota_exceeded")

_STATUS_TEXT = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 410: "Gone",
                422: "Unprocessable content", 429: "Too many requests", 500: "Generation failed",
                503: "Service unavailable"}


def problems(*codes: str) -> dict[int, ResponseSpec]:
    """Problem-document responses of a route, one example per code, grouped by status."""
    by_status: dict[int, list[Example]] = {}
    for code in codes:
        status, title, detail = _PROBLEMS[code]
        by_status.setdefault(status, []).append(
            LiteralExample(id=code, summary=code, value=_value(problem(status, code, title, detail))))
    return {status: ResponseSpec(data_container=wire.Problem, media_type=PROBLEM_MEDIA_TYPE, examples=examples,
                                 description=f"{_STATUS_TEXT[status]}: an RFC 9457 problem document",
                                 generate_examples=False)
            for status, examples in by_status.items()}


IGNORED_EXTENSIONS = ResponseHeader(
    name="LMSP-Ignored-Extensions", documentation_only=True,
    description="The request's extensions that had no effect (unknown names, or a reasoning budget for a model "
                "without reasoning), comma-separated and percent-encoded; absent when there are none.")


def ok(data_container: Any, description: str, *examples: Example, media_type: str = "application/json"
       ) -> ResponseSpec:
    return ResponseSpec(data_container=data_container, description=description, examples=list(examples),
                        media_type=media_type, generate_examples=False)


def event_stream(description: str, value: str) -> ResponseSpec:
    return ok(str, description, LiteralExample(id="events", summary="Server-sent events", value=value),
              media_type="text/event-stream")


def _events(value: str) -> Example:
    return LiteralExample(id="events", summary="Server-sent events", value=value)


STREAMED_RESPONSE = streamdoc.streaming(
    "With `stream: true`: the response's events (6.3), each with its `id`, up to the final one", RESPONSE_EVENTS,
    _events(EVENT_STREAM))
TASK_EVENT_STREAM_OPERATION = streamdoc.streaming(
    "The task's events, then the end of the stream", TASK_EVENTS, _events(TASK_EVENT_STREAM),
    parameters={"after": EVENT_CURSOR, "Last-Event-ID": EVENT_CURSOR})


def config() -> OpenAPIConfig:
    return OpenAPIConfig(
        title="LMSP service", version="1.0", path="/schema",
        description="An LMSP 1.0 generation service: responses, resumable tasks, models. Errors are RFC 9457 "
                    "problem documents with a stable `code`; see docs/protocol.md for the decisions the spec "
                    "leaves open.",
        openapi_router=Router("/schema", route_handlers=[], opt={"public": True}, include_in_schema=False),
        tags=[Tag(name="openai", description=OPENAI_TAG)],
    )


# OpenAPI describes no WebSocket: the tag of the /v1 routes says what ws://HOST/v1/responses takes
OPENAI_TAG = (
    "OpenAI's routes. `/v1/responses` also takes a WebSocket (OpenAI's WebSocket mode): the handshake carries "
    "`Authorization: Bearer` (scope `responses:write`; a refusal is the HTTP status with OpenAI's error object); "
    "each text message `{\"type\": \"response.create\", ...}` holds the body of `POST /v1/responses` and is "
    "answered, one after another, by that response's events, one JSON object a message, as its event stream "
    "carries them (with the create's `stream_id`, if any). A `store: false` response is continued on the same "
    "socket by `previous_response_id` with only the new input; a refused message gets "
    "`{\"type\": \"error\", \"status\", \"error\": {...}}` (`previous_response_not_found` for an unknown "
    "`previous_response_id`) and the socket goes on. See docs/protocol.md, \"OpenAI compatibility\"."
)
