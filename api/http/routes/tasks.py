"""The tasks API: background generation whose events can be followed and resumed (6.4).

POST /lmsp/v1/tasks, GET /lmsp/v1/tasks (the caller's tasks), GET /lmsp/v1/tasks/{id},
GET /lmsp/v1/tasks/{id}/events, POST /lmsp/v1/tasks/{id}/cancel. See docs/protocol.md for the
decisions the spec leaves open.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.openapi.spec import Example
from litestar.params import Body, HeaderParameter, Parameter
from litestar.response import Stream

from api.follow import framing, streams
from api.http.ignoredextensions import ignored_extensions
from api.http.openapi import document as doc
from api.process import Services
from api.submission import idempotency
from api.submission.idempotency import REPLAYED, IdempotencyKey
from api.submission.submit import submit
from lmsp_core import wire
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.records import CancelOutcome, ListCursor, TaskRecord
from lmsp_core.store.tenants import credentials
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest, NotFound

CANCEL_WAIT = 3.0  # how long cancel waits for a running task to stop before answering
MAX_PAGE = 100

_QUEUED = doc.ok(wire.Task, "The queued task", doc.example("Queued", doc.QUEUED_TASK))
_FINAL = doc.ok(wire.Task, "The task", doc.example("Queued", doc.QUEUED_TASK),
                doc.example("Completed, with its response", doc.FINAL_TASK))
_PAGE = doc.ok(wire.TaskList, "A page of tasks, newest first", doc.example("A page", wire.TaskList(
    data=[doc.FINAL_TASK], has_more=True, next_cursor=f"1794200000000.{doc.TASK_ID}")))


class TasksController(Controller):
    path = "/lmsp/v1/tasks"
    tags = ["tasks"]

    @post(status_code=202, summary="Create a task", opt={"scope": credentials.TASKS_WRITE},
          description="Queues a generation and answers `202` at once, with `Location: /lmsp/v1/tasks/{id}`. The "
                      "body is that of `POST /lmsp/v1/responses` (`stream` is ignored); follow the task at "
                      "`/lmsp/v1/tasks/{id}/events`. A repeat with the same `Idempotency-Key` and body returns the "
                      "same task.",
          response_headers=[doc.IGNORED_EXTENSIONS],
          responses={202: _QUEUED, **doc.problems(*doc.SUBMISSION, *doc.GUARDED)})
    async def create_task(
        self, data: Annotated[wire.ResponseRequest, Body(examples=doc.REQUEST_EXAMPLES)], services: Services,
        owner: str, idempotency_key: IdempotencyKey = None,
    ) -> Response[wire.Task]:
        record, repeated = await submit(services, data, kind="task", owner=owner,
                                        idempotency_key=idempotency.parse_key(idempotency_key))
        headers = {"Location": f"{self.path}/{record.id}", **(REPLAYED if repeated else {}),
                   **ignored_extensions(services, data)}
        return Response(record.to_wire(), status_code=202, headers=headers)

    @get(summary="List tasks", opt={"scope": credentials.TASKS_READ},
         description="The caller's tasks, newest first, `limit` per page (default 20, at most 100). When "
                     "`has_more` is true, pass `next_cursor` as `cursor` for the next page. Tasks leave the list "
                     "when their record expires (`LMSP_TASK_RETENTION` after they end).",
         responses={200: _PAGE, **doc.problems("invalid_request", "invalid_cursor", "service_unavailable",
                                               *doc.GUARDED)})
    async def list_tasks(
        self, services: Services, owner: str,
        limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE, description="tasks per page")] = 20,
        cursor: Annotated[str | None, Parameter(description="`next_cursor` of the previous page",
                                                examples=[Example(value=f"1794200000000.{doc.TASK_ID}")],
                                                schema_extra=doc.LIST_CURSOR)] = None,
    ) -> wire.TaskList:
        after = None
        if cursor:
            after = ListCursor.decode(cursor)
            if after is None:
                raise InvalidRequest(f"Listing cursor {cursor!r} is not one this service returned.",
                                     code="invalid_cursor")
        records, more = await services.store.list_owned(owner, limit, after)
        next_cursor = ListCursor.after(records[-1]).encode() if more and records else None
        return wire.TaskList(data=[record.to_wire() for record in records], has_more=more, next_cursor=next_cursor)

    @get("/{task_id:str}", summary="Get a task", description="The task, with its response once it is final.",
         opt={"scope": credentials.TASKS_READ},
         responses={200: _FINAL, **doc.problems("invalid_request", "task_not_found", "service_unavailable",
                                                *doc.GUARDED)})
    async def get_task(self, task_id: str, services: Services, owner: str) -> wire.Task:
        return (await load_task(services, task_id, owner)).to_wire()

    @get("/{task_id:str}/events", summary="Follow a task's events", opt={"scope": credentials.TASKS_READ},
         operation_class=doc.TASK_EVENT_STREAM_OPERATION,
         description="Server-sent events after `?after=N` or `Last-Event-ID` (`after` wins; an empty `after` counts "
                     "as absent), then live events until the final one. Every event has an `id`. While the task "
                     "waits in its queue, a comment line `: queued <position>` gives its queue position; with "
                     "`?queue_events=true` it comes as a `task.queued` event instead (an extra event without `id`). "
                     "`410 event_history_expired` once the events have expired: the result is still at "
                     "`GET /lmsp/v1/tasks/{id}`.",
         responses={200: doc.event_stream("The task's events, then the end of the stream", doc.TASK_EVENT_STREAM),
                    **doc.problems("invalid_request", "invalid_cursor", "task_not_found", "event_history_expired",
                                   "service_unavailable", "too_many_streams", *doc.GUARDED)})
    async def task_events(
        self, task_id: str, services: Services, owner: str, after: str | None = None,
        last_event_id: Annotated[str | None, HeaderParameter(name="Last-Event-ID")] = None,
        queue_events: Annotated[bool, Parameter(description="queue positions as `task.queued` events (without "
                                                            "`id`) rather than comment lines")] = False,
    ) -> Stream:
        header = parse_cursor(last_event_id)  # refused when malformed even where `after` wins, as documented
        cursor = parse_cursor(after) if after else header  # an empty `after` is no cursor: the header applies
        record = await load_task(services, task_id, owner)
        if record.final:
            if cursor >= record.last_event_id:
                return framing.response(_nothing())
            await streams.check_history(services, record, f"The events of task {record.id} have expired; "
                                        f"GET /lmsp/v1/tasks/{record.id} still returns its result.")
        notices = framing.QUEUE_EVENTS if queue_events else framing.QUEUE_COMMENTS
        slot = await services.limits.open_stream(owner)
        return streams.stream(services, slot, record, framing.TaskFrames(services, record, notices), after=cursor)

    @post("/{task_id:str}/cancel", status_code=200, summary="Cancel a task", opt={"scope": credentials.TASKS_WRITE},
          description="A queued task never runs; a running one stops within a few tokens (the call waits up to "
                      "3 s for that) and keeps its partial output. Idempotent; a final task is left as it is.",
          responses={200: _FINAL, **doc.problems("invalid_request", "task_not_found", "service_unavailable",
                                                 *doc.GUARDED)})
    async def cancel_task(self, task_id: str, services: Services, owner: str) -> wire.Task:
        record = await load_task(services, task_id, owner)
        status = await services.store.cancel(record, replicated=True)
        if status is CancelOutcome.STOPPING:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(streams.until_final(services, record), CANCEL_WAIT)
        return (await load_task(services, task_id, owner)).to_wire()


def parse_cursor(raw: str | None) -> int:
    """The event number of ``after`` / ``Last-Event-ID``; absent or empty: 0 (from the start)."""
    if raw is None or raw == "":
        return 0
    value = raw.strip()
    if not value.isdigit() or not value.isascii():
        raise InvalidRequest(f"Event cursor {raw!r} is not a non-negative integer.", code="invalid_cursor")
    digits = value.lstrip("0") or "0"
    # compared as digits first: int() of thousands of digits is slow, and refused past 4300
    if len(digits) > len(str(eventlog.MAX_EVENT_ID)) or int(digits) > eventlog.MAX_EVENT_ID:
        raise InvalidRequest(f"The event cursor is above the largest event id there can be "
                             f"({eventlog.MAX_EVENT_ID}).", code="invalid_cursor")
    return int(digits)


async def load_task(services: Services, task_id: str, owner: str) -> TaskRecord:
    record = await services.store.get(task_id) if ids.is_id(task_id, ids.TASK) else None
    if record is None or record.owner != owner or record.kind != "task":
        raise NotFound(f"Task {task_id!r} does not exist.", code="task_not_found")
    return record


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield
