"""The tasks API: background generation whose events can be followed and resumed (6.4).

POST /lmsp/v1/tasks, GET /lmsp/v1/tasks/{id}, GET /lmsp/v1/tasks/{id}/events,
POST /lmsp/v1/tasks/{id}/cancel. See docs/protocol.md for the decisions the spec leaves open.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.params import HeaderParameter
from litestar.response import ServerSentEvent, ServerSentEventMessage

from api import idempotency
from api.idempotency import REPLAYED, IdempotencyKey
from api.services import Services
from api.sse import relay
from api.submit import submit
from lmsp_core import eventlog, ids, tokens, wire
from lmsp_core.errors import Gone, InvalidRequest, NotFound
from lmsp_core.tasks import TaskRecord

CANCEL_WAIT = 3.0  # how long cancel waits for a running task to stop before answering


class TasksController(Controller):
    path = "/lmsp/v1/tasks"
    tags = ["tasks"]

    @post(status_code=202, summary="Create a task", opt={"scope": tokens.TASKS_WRITE},
          description="Queues a generation and answers at once; follow it at `/lmsp/v1/tasks/{id}/events`. "
                      "A repeat with the same `Idempotency-Key` and body returns the same task.")
    async def create_task(self, data: wire.ResponseRequest, services: Services, owner: str,
                          idempotency_key: IdempotencyKey = None) -> Response[wire.Task]:
        record, repeated = await submit(services, data, kind="task", owner=owner,
                                        idempotency_key=idempotency.parse_key(idempotency_key))
        headers = {"Location": f"{self.path}/{record.id}", **(REPLAYED if repeated else {})}
        return Response(record.to_wire(), status_code=202, headers=headers)

    @get("/{task_id:str}", summary="Get a task", description="The task, with its response once it is final.",
         opt={"scope": tokens.TASKS_READ})
    async def get_task(self, task_id: str, services: Services, owner: str) -> wire.Task:
        return (await load_task(services, task_id, owner)).to_wire()

    @get("/{task_id:str}/events", summary="Follow a task's events", opt={"scope": tokens.TASKS_READ},
         description="Server-sent events after `?after=N` or `Last-Event-ID` (`after` wins), then live events "
                     "until the final one. `410 event_history_expired` once the events have expired.")
    async def task_events(
        self, task_id: str, services: Services, owner: str, after: str | None = None,
        last_event_id: Annotated[str | None, HeaderParameter(name="Last-Event-ID")] = None,
    ) -> ServerSentEvent:
        cursor = parse_cursor(after if after is not None else last_event_id)
        record = await load_task(services, task_id, owner)
        if record.final:
            if cursor >= record.last_event_id:
                return ServerSentEvent(_nothing())
            if not await eventlog.history_exists(services.redis, record.id):
                raise Gone(f"The events of task {record.id} have expired; GET /lmsp/v1/tasks/{record.id} still "
                           "returns its result.")
        events = relay(services, record, cursor, queue_notices=True)
        slot = await services.limits.open_stream(owner)
        return ServerSentEvent(slot.wrap(events))

    @post("/{task_id:str}/cancel", status_code=200, summary="Cancel a task", opt={"scope": tokens.TASKS_WRITE},
          description="A queued task never runs; a running one stops within a few tokens. Idempotent.")
    async def cancel_task(self, task_id: str, services: Services, owner: str) -> wire.Task:
        record = await load_task(services, task_id, owner)
        if await services.store.cancel(record) == "in_progress":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_until_final(services, record), CANCEL_WAIT)
        return (await load_task(services, task_id, owner)).to_wire()


def parse_cursor(raw: str | None) -> int:
    if raw is None or raw == "":
        return 0
    value = raw.strip()
    if not value.isdigit() or not value.isascii():
        raise InvalidRequest(f"Event cursor {raw!r} is not a non-negative integer.", code="invalid_cursor")
    return int(value)


async def load_task(services: Services, task_id: str, owner: str) -> TaskRecord:
    record = await services.store.get(task_id) if ids.is_id(task_id, ids.TASK) else None
    if record is None or record.owner != owner or record.kind != "task":
        raise NotFound(f"Task {task_id!r} does not exist.", code="task_not_found")
    return record


async def _until_final(services: Services, record: TaskRecord) -> None:
    async for _ in services.hub.follow(record.id, record.last_event_id, CANCEL_WAIT):
        pass


async def _nothing() -> AsyncIterator[ServerSentEventMessage]:
    return
    yield
