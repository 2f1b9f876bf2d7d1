"""OpenAI's Responses API on the service's tasks: ``POST /v1/responses``, ``GET /v1/responses/{id}``
(with ``?stream=true&starting_after=N``), ``POST /v1/responses/{id}/cancel``, ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, and ``POST /v1/responses/input_tokens``
(a prompt's tokens, counted without generating).

A response is a task: direct (its connection's, as ``POST /lmsp/v1/responses``) unless
``background: true``, which makes it a task of the tasks API, listed at ``/lmsp/v1/tasks`` and
followed, resumed and cancelled here or there alike. Its id is the task's response id, found again
through the stored response (``store`` defaults to true).
"""

import asyncio
import contextlib
from typing import Annotated, Any

from litestar import Controller, Request, Response, delete, get, post
from litestar.params import Body, Parameter

from api.follow import streams
from api.follow.framing import ResponseFrames
from api.http.openapi import openai as docs
from api.openai import PREFIX
from api.openai import requests as rq
from api.openai.conversations import turn_of
from api.openai.errors import FailedGeneration, errors_only, with_param
from api.openai.inputitems import MAX_PAGE, Order, input_items, page
from api.openai.objects import InputItemList, InputTokens
from api.openai.objects import Response as ResponseObject
from api.openai.rendering import ResponseView, response_object
from api.openai.translation import RESPONSES_PARAMS, counted_request, responses_request
from api.process import Services
from api.storedresponses import delete_stored
from api.submission import idempotency, submit
from api.submission.idempotency import REPLAYED, IdempotencyKey
from lmsp_core import wire
from lmsp_core.store.objects.conversations import StoredResponse
from lmsp_core.store.tasks.records import CancelOutcome, Kind, TaskRecord
from lmsp_core.store.tenants import credentials
from lmsp_core.store.tenants.credentials import Identity
from lmsp_core.wire import ids
from lmsp_core.wire.errors import Forbidden, GenerationFailed, Gone, InvalidRequest, LmspError, NotFound

CANCEL_WAIT = 3.0  # as POST /lmsp/v1/tasks/{id}/cancel
ENDPOINT = "openai.responses"  # Idempotency-Key fingerprints: never shared with another route
# a streaming repeat replays the task's events from the start: they must still exist
_EXPIRED = "The events of this response have expired; repeat the request without stream to get it."

_STREAMED = docs.with_event_stream(
    "OpenAI's Responses stream events; `sequence_number` is the cursor of `starting_after`", docs.RESPONSE_EVENTS,
    docs.EVENT_STREAM)


class OpenAIResponsesController(Controller):
    path = f"{PREFIX}/responses"
    tags = ["openai"]

    @post(status_code=200, summary="Create a response (OpenAI)", opt={"scope": credentials.RESPONSES_WRITE},
          operation_class=_STREAMED, after_request=errors_only,
          description="OpenAI's `responses.create`: the response object, or with `stream: true` its events "
                      "(`text/event-stream`). `background: true` makes it a task (also `tasks:write`): the "
                      "answer comes at once (`queued`), and the response is followed, resumed and cancelled by id. "
                      "Unsupported parameters are refused with `400` naming them; see docs/protocol.md, \"OpenAI "
                      "compatibility\".",
          responses={200: docs.ok(ResponseObject, "The response (with `background`: as queued)", docs.RESPONSE),
                     **docs.errors(*docs.GENERATION_ERRORS, *docs.CONTINUATION_ERRORS, "conversation_not_found",
                                   "conversation_locked", "mutually_exclusive_parameters")})
    async def create_response(
        self, request: Request[Any, Any, Any],
        data: Annotated[rq.ResponsesRequest, Body(examples=docs.RESPONSES_REQUESTS)],
        services: Services, identity: Identity, idempotency_key: IdempotencyKey = None,
    ) -> Response[Any]:
        key = idempotency.parse_key(idempotency_key)
        try:
            lmsp = responses_request(data, services.catalog.get(data.model))
            if data.background and credentials.TASKS_WRITE not in identity.scopes:
                raise Forbidden("A background response is a task: it needs the 'tasks:write' scope too.",
                                scope=credentials.TASKS_WRITE)
            kind: Kind = "task" if data.background else "direct"
            record, repeated, slot = await streams.open(services, lmsp, kind=kind, owner=identity.principal,
                                                        stream=bool(data.stream), expired=_EXPIRED,
                                                        idempotency_key=key, endpoint=f"{ENDPOINT}.{kind}",
                                                        history=turn_of(services.conversation_objects, lmsp,
                                                                        identity.principal))
        except LmspError as exc:
            raise with_param(exc, RESPONSES_PARAMS) from None
        headers = REPLAYED if repeated else {}
        view = ResponseView(record)
        if slot is not None:
            return streams.stream(services, slot, record, ResponseFrames(view),
                                  cancel=kind == "direct" and key is None, headers=headers)
        if kind == "task":
            return _json(response_object(view), headers)
        if not await streams.final_or_disconnect(services, record, request.receive, cancel=key is None):
            return Response(content=b"", status_code=499)
        return _json(_final(view, await services.store.get(record.id)), headers)

    # a path of its own, so that /{response_id} never takes it for an id
    @post("/input_tokens", status_code=200, summary="Count a response's input tokens (OpenAI)",
          opt={"scope": credentials.RESPONSES_READ}, after_request=errors_only,
          description="OpenAI's `responses.input_tokens.count`: the tokens of the prompt that `POST /v1/responses` "
                      "would give the model for the same `input`, `instructions`, `tools` and `previous_response_id`, "
                      "rendered with the model's own chat template and tokenizer. Nothing is generated or stored; "
                      "the request is checked as a response's is, but a prompt longer than the context window is "
                      "counted, not refused. `model` is required.",
          responses={200: docs.ok(InputTokens, "The prompt's tokens", docs.INPUT_TOKENS),
                     **docs.errors(*docs.COMMON_ERRORS, *docs.REQUEST_ERRORS, *docs.CONTINUATION_ERRORS,
                                   "model_unavailable")})
    async def count_input_tokens(
        self, data: Annotated[rq.InputTokensRequest, Body(examples=docs.INPUT_TOKENS_REQUESTS)], services: Services,
        owner: str,
    ) -> Response[Any]:
        try:
            lmsp = counted_request(data, services.catalog.get(data.model))
            tokens = await submit.count_input_tokens(services, lmsp, owner=owner)
        except LmspError as exc:
            raise with_param(exc, RESPONSES_PARAMS) from None
        return Response(content=wire.encoder.encode(InputTokens(input_tokens=tokens)), media_type="application/json")

    @get("/{response_id:str}", summary="Retrieve a response (OpenAI)", opt={"scope": credentials.RESPONSES_READ},
         operation_class=_STREAMED, after_request=errors_only,
         description="OpenAI's `responses.retrieve`: a stored response of the caller (`queued` or `in_progress` "
                     "without output until it is final). With `stream=true` its events from the start, or those "
                     "after `starting_after`, then live ones until the last; `410` once its events have expired.",
         responses={200: docs.ok(ResponseObject, "The response", docs.RESPONSE),
                    **docs.errors(*docs.COMMON_ERRORS, "unsupported_value", "response_not_found",
                                  "event_history_expired", "too_many_streams")})
    async def retrieve_response(
        self, response_id: str, services: Services, owner: str, stream: bool = False,
        starting_after: Annotated[int | None, Parameter(ge=-1, description="stream the events numbered above "
                                                                             "this `sequence_number`")] = None,
        include_obfuscation: Annotated[bool | None, Parameter(
            description="`false` only: stream obfuscation is not supported",
            schema_extra={"type": "boolean", "oneOf": None, "enum": [False]})] = None,
        include: Annotated[list[str] | None, Parameter(
            description="nothing can be included: absent only",
            schema_extra={"type": "array", "oneOf": None, "items": {"type": "string"}, "maxItems": 0})] = None,
    ) -> Response[Any]:
        if include_obfuscation:
            raise InvalidRequest("Stream obfuscation is not supported.", code="unsupported_value",
                                 extra={"param": "include_obfuscation"})
        if include:
            raise InvalidRequest(f"include {include!r} is not supported: nothing can be included.",
                                 code="unsupported_value", extra={"param": "include"})
        stored, record = await _load(services, response_id, owner)
        if not stream:
            if record is None:  # the task's record expired before the stored response
                return _json(response_object(_view(stored), stored=stored.as_response()))
            return _json(response_object(ResponseView(record)))
        expired = f"The events of response {response_id} have expired; retrieve it without stream."
        if record is None:
            raise Gone(expired)
        await streams.check_history(services, record, expired)
        slot = await services.limits.open_stream(owner)
        after = -1 if starting_after is None else starting_after
        return streams.stream(services, slot, record, ResponseFrames(ResponseView(record), after))

    @post("/{response_id:str}/cancel", status_code=200, summary="Cancel a response (OpenAI)",
          opt={"scope": credentials.TASKS_WRITE}, after_request=errors_only,
          description="OpenAI's `responses.cancel`, for background responses (a direct one stops when its client "
                      "goes away): a queued one never runs, a running one stops within a few tokens (the call "
                      "waits up to 3 s) and keeps its output. Idempotent; a final response is returned as it is.",
          responses={200: docs.ok(ResponseObject, "The response", docs.RESPONSE),
                     **docs.errors(*docs.COMMON_ERRORS, "not_cancellable", "response_not_found")})
    async def cancel_response(self, response_id: str, services: Services, owner: str) -> Response[Any]:
        stored, record = await _load(services, response_id, owner)
        if record is None:
            return _json(response_object(_view(stored), stored=stored.as_response()))
        if record.kind != "task":
            raise InvalidRequest("Only background responses can be cancelled; a direct response stops when its "
                                 "client disconnects.", code="not_cancellable")
        if await services.store.cancel(record) is CancelOutcome.STOPPING:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(streams.until_final(services, record), CANCEL_WAIT)
        return _json(response_object(ResponseView(await services.store.get(record.id) or record)))

    @delete("/{response_id:str}", status_code=200, summary="Delete a response (OpenAI)",
            opt={"scope": credentials.RESPONSES_WRITE}, after_request=errors_only,
            description="OpenAI's `responses.delete`: the stored response can no longer be retrieved, listed or "
                        "continued (`previous_response_id`), nor a conversation through it. One that is not final "
                        "yet is cancelled first. Answers `{\"id\", \"object\": \"response.deleted\", \"deleted\": "
                        "true}`; a second delete is `404`.",
            responses={200: docs.ok(wire.DeletedResponse, "The response was deleted", docs.DELETED),
                       **docs.errors(*docs.COMMON_ERRORS, "response_not_found")})
    async def delete_response(self, response_id: str, services: Services, owner: str) -> Response[Any]:
        deleted = await delete_stored(services, response_id, owner)
        return Response(content=wire.encoder.encode(deleted), media_type="application/json")

    @get("/{response_id:str}/input_items", summary="List a response's input items (OpenAI)",
         opt={"scope": credentials.RESPONSES_READ}, after_request=errors_only,
         description="OpenAI's `responses.input_items.list`: the input items of the response's own turn (not "
                     "`instructions`, nor earlier turns), each with an `id`, `limit` per page, newest first "
                     "(`order=desc`, the default) or in order (`asc`); `after` is the `id` of the last item seen.",
         responses={200: docs.ok(InputItemList, "A page of input items", docs.INPUT_ITEMS),
                    **docs.errors(*docs.COMMON_ERRORS, "unsupported_value", "invalid_cursor", "response_not_found")})
    async def list_input_items(
        self, response_id: str, services: Services, owner: str,
        limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE, description="items per page")] = 20,
        order: Annotated[Order, Parameter(description="`desc`: the last input item first")] = "desc",
        after: Annotated[str | None, Parameter(description="the `id` of the item to list after")] = None,
        include: Annotated[list[str] | None, Parameter(
            description="nothing can be included: absent only",
            schema_extra={"type": "array", "oneOf": None, "items": {"type": "string"}, "maxItems": 0})] = None,
    ) -> Response[Any]:
        if include:
            raise InvalidRequest(f"include {include!r} is not supported: nothing can be included.",
                                 code="unsupported_value", extra={"param": "include"})
        if not ids.is_id(response_id, ids.RESPONSE):
            raise NotFound(f"Response {response_id!r} does not exist.", code="response_not_found")
        turn = await services.conversations.load(response_id, owner)
        listed = page(input_items(turn), limit=limit, order=order, after=after)
        return Response(content=wire.encoder.encode(listed), media_type="application/json")


def _json(value: ResponseObject, headers: dict[str, str] | None = None) -> Response[Any]:
    return Response(content=wire.encoder.encode(value), media_type="application/json", headers=headers or {})


def _final(view: ResponseView, record: TaskRecord | None) -> ResponseObject:
    if record is None or record.response is None:
        raise GenerationFailed("The response was lost before it could be returned.")
    if record.status == "failed":
        raise FailedGeneration(record.problem() or GenerationFailed("Generation failed.").problem())
    return response_object(view, record)


async def _load(services: Services, response_id: str, owner: str) -> tuple[StoredResponse, TaskRecord | None]:
    """The caller's stored response and its task (None once the task's record has expired)."""
    if not ids.is_id(response_id, ids.RESPONSE):
        raise NotFound(f"Response {response_id!r} does not exist.", code="response_not_found")
    stored = await services.conversations.load(response_id, owner)
    record = await services.store.get(stored.task_id)
    return stored, record if record is not None and record.owner == owner else None


def _view(stored: StoredResponse) -> ResponseView:
    """What remains of a response whose task record expired: its stored turn (no request options but
    its extensions: metadata, instructions, user, tier)."""
    request = wire.ResponseRequest(model=stored.model, input=stored.input, store=True,
                                   previous_response_id=stored.previous_response_id, extensions=stored.extensions)
    return ResponseView(TaskRecord(id=stored.task_id, model=stored.model, owner=stored.owner, kind="direct",
                                   status="completed", created_at=stored.created_at, response_id=stored.response_id,
                                   request=wire.encoder.encode(request)))
