"""POST /lmsp/v1/responses: a direct response, synchronous (6.2) or streamed (6.3); GET and DELETE
/lmsp/v1/responses/{id}: a stored one.

A direct response is a task whose lifetime is the HTTP connection: if the client goes away before
the final event, the task is cancelled and its worker stops generating (6.3 SHOULD). With an
``Idempotency-Key`` the client has said it will repeat the request, so the task outlives the
connection and a repeat waits for (or relays) the same task.
"""

from typing import Annotated, Any

from litestar import Controller, Request, Response, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Body

from api.follow import streams
from api.follow.framing import TaskFrames
from api.http.ignoredextensions import ignored_extensions
from api.http.openapi import document as doc
from api.http.problems import problem_response
from api.process import Services
from api.storedresponses import delete_stored
from api.submission import idempotency
from api.submission.idempotency import REPLAYED, IdempotencyKey
from lmsp_core import wire
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.store.tenants import credentials
from lmsp_core.wire import ids
from lmsp_core.wire.errors import GenerationFailed, NotFound

# a streaming repeat replays the task's events from the start: they must still exist
_EXPIRED = "The events of this response have expired; repeat the request with stream: false to get the response."


class ResponsesController(Controller):
    path = "/lmsp/v1/responses"
    tags = ["responses"]

    @post(status_code=200, summary="Create a response", opt={"scope": credentials.RESPONSES_WRITE},
          description="Generates a response, returned when it is final (`stream: false`, 6.2) or as server-sent "
                      "events (`stream: true`, 6.3). A direct response belongs to its connection: if the client "
                      "goes away, generation stops (unless it carries an `Idempotency-Key`). For resumable output "
                      "create a task instead. A repeat with the same `Idempotency-Key` and body answers from the "
                      "same generation.",
          response_headers=[doc.IGNORED_EXTENSIONS], operation_class=doc.STREAMED_RESPONSE,
          responses={
              200: ResponseSpec(data_container=wire.Response, generate_examples=False,
                                description="The final response (6.2). With `stream: true`: `text/event-stream` "
                                            "(6.3), the events shown for `GET /lmsp/v1/tasks/{task_id}/events` "
                                            "without the queue position.",
                                examples=[doc.example("Completed", doc.RESPONSE)]),
              **doc.problems(*doc.SUBMISSION, "generation_failed", "too_many_streams", *doc.GUARDED),
          })
    async def create_response(self, request: Request[Any, Any, Any],
                              data: Annotated[wire.ResponseRequest, Body(examples=doc.REQUEST_EXAMPLES)],
                              services: Services, owner: str, idempotency_key: IdempotencyKey = None) -> Response[Any]:
        key = idempotency.parse_key(idempotency_key)
        record, repeated, slot = await streams.open(services, data, kind="direct", owner=owner, stream=data.stream,
                                                    expired=_EXPIRED, idempotency_key=key)
        headers = {**(REPLAYED if repeated else {}), **ignored_extensions(services, data)}
        if slot is not None:
            return streams.stream(services, slot, record, TaskFrames(services, record), cancel=key is None,
                                  headers=headers)
        if not await streams.final_or_disconnect(services, record, request.receive, cancel=key is None):
            return Response(content=b"", status_code=499)
        return await _final_answer(services, record, headers)

    @get("/{response_id:str}", summary="Get a stored response", opt={"scope": credentials.RESPONSES_READ},
         description="A response created with `store: true` by the same principal: the response object (6.2), "
                     "`in_progress` with no output while it is being generated. Unknown, expired, another "
                     "principal's or unstored responses are all `404 response_not_found`.",
         responses={200: ResponseSpec(data_container=wire.Response, generate_examples=False,
                                      description="The stored response (6.2)",
                                      examples=[doc.example("Completed", doc.RESPONSE)]),
                    **doc.problems("invalid_request", "response_not_found", "service_unavailable", *doc.GUARDED)})
    async def get_response(self, response_id: str, services: Services, owner: str) -> wire.Response:
        if not ids.is_id(response_id, ids.RESPONSE):
            raise NotFound(f"Response {response_id!r} does not exist.", code="response_not_found")
        return (await services.conversations.load(response_id, owner)).as_response()

    @delete("/{response_id:str}", status_code=200, summary="Delete a stored response",
            opt={"scope": credentials.RESPONSES_WRITE},
            description="Deletes a stored response of the caller: it can no longer be retrieved or continued "
                        "(`previous_response_id`), nor a conversation through it. One that is not final yet is "
                        "cancelled first. Unknown, another principal's or already deleted responses are "
                        "`404 response_not_found`. (Not part of LMSP 1.0; the answer is OpenAI's.)",
            responses={200: doc.ok(wire.DeletedResponse, "The response was deleted",
                                   doc.example("Deleted", wire.DeletedResponse(id=doc.RESPONSE_ID))),
                       **doc.problems("invalid_request", "response_not_found", "service_unavailable",
                                      *doc.GUARDED)})
    async def delete_response(self, response_id: str, services: Services, owner: str) -> wire.DeletedResponse:
        return await delete_stored(services, response_id, owner)


async def _final_answer(services: Services, record: TaskRecord, headers: dict[str, str]) -> Response[Any]:
    final = await services.store.get(record.id)
    if final is None or final.response is None:
        raise GenerationFailed("The response was lost before it could be returned.")
    if final.status == "failed":
        problem = final.problem() or GenerationFailed("Generation failed.").problem()
        return problem_response(problem, headers)
    return Response(content=final.response, media_type="application/json", headers=headers)
