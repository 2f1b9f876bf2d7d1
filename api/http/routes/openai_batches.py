"""OpenAI's Batch API on the service's tasks: ``POST /v1/batches``, ``GET /v1/batches``,
``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.

A batch is a record in Redis that the API processes' batch drivers (``api.background.batchdriver``) move along;
these routes create, read and cancel it. Each line of its input file becomes a task of the batch's
owner, listed at ``/lmsp/v1/tasks`` with its ``batch_id``.
"""

import time
from typing import Annotated, Any

import msgspec
from litestar import Controller, Response, get, post
from litestar.params import Body, Parameter

from api.http.openapi import openai as docs
from api.openai import PREFIX
from api.openai import batches as ob
from api.openai.errors import errors_only
from api.process import Services
from lmsp_core import tracing
from lmsp_core.store.objects.batches import BatchRecord, BatchStore
from lmsp_core.store.tenants import credentials
from lmsp_core.store.tenants.credentials import Identity
from lmsp_core.wire import extensions as ext
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest, NotFound

MAX_PAGE = 100


def _json(value: Any, status: int = 200) -> Response[Any]:
    return Response(content=msgspec.json.encode(value), media_type="application/json", status_code=status)


def _store(services: Services) -> BatchStore:
    return BatchStore(services.redis, services.settings.task_retention)


class OpenAIBatchesController(Controller):
    path = f"{PREFIX}/batches"
    tags = ["openai"]

    @post(status_code=200, summary="Create a batch (OpenAI)", opt={"scope": credentials.TASKS_WRITE},
          after_request=errors_only,
          description="OpenAI's `batches.create`: each line of the input file (purpose `batch`) becomes a task of "
                      "the caller at `low` priority. The batch is `validating`, then `in_progress`, `finalizing` "
                      "and `completed` (or `failed`, `expired`, `cancelling`, `cancelled`); poll it, then download "
                      "`output_file_id` and `error_file_id` with `GET /v1/files/{id}/content`. `completion_window` "
                      "is `24h` or shorter (`1h`, `30m`, `90s`).",
          responses={200: docs.ok(ob.Batch, "The batch", docs.BATCH),
                     **docs.errors(*docs.COMMON_ERRORS, "unsupported_parameter", "unsupported_value",
                                   "file_not_found")})
    async def create_batch(self, data: Annotated[ob.BatchCreate, Body(examples=docs.BATCH_REQUESTS)],
                           services: Services, identity: Identity) -> Response[Any]:
        if data.endpoint not in ob.ENDPOINTS:
            raise InvalidRequest(f"endpoint must be one of {', '.join(ob.ENDPOINTS)}.", code="unsupported_value",
                                 extra={"param": "endpoint"})
        window = ob.window_seconds(data.completion_window)
        _check_metadata(data.metadata)
        source = await services.files.get(data.input_file_id, identity.principal)
        if source is None or source.purpose != "batch":
            raise NotFound(f"No file {data.input_file_id!r} with purpose 'batch' exists.", code="file_not_found")
        now = time.time()
        record = BatchRecord(id=ids.new_id(ids.BATCH), owner=identity.principal, endpoint=data.endpoint,
                             input_file_id=data.input_file_id, completion_window=data.completion_window,
                             status="validating", created_at=now, expires_at=now + window,
                             metadata=msgspec.json.encode(data.metadata).decode() if data.metadata else None,
                             trace=tracing.current().traceparent)
        await _store(services).create(record)
        return _json(ob.batch_object(record))

    @get(summary="List batches (OpenAI)", opt={"scope": credentials.TASKS_READ}, after_request=errors_only,
         description="OpenAI's `batches.list`: the caller's batches, newest first; `after` is the last id of the "
                     "previous page.",
         responses={200: docs.ok(ob.BatchList, "A page of batches", docs.BATCH_LIST),
                    **docs.errors(*docs.COMMON_ERRORS)})
    async def list_batches(self, services: Services, identity: Identity, after: str | None = None,
                           limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE)] = 20) -> Response[Any]:
        records, more = await _store(services).list_owned(identity.principal, limit, after)
        data = [ob.batch_object(record) for record in records]
        return _json(ob.BatchList(data=data, first_id=data[0].id if data else None,
                                  last_id=data[-1].id if data else None, has_more=more))

    @get("/{batch_id:str}", summary="Retrieve a batch (OpenAI)", opt={"scope": credentials.TASKS_READ},
         after_request=errors_only, description="OpenAI's `batches.retrieve`.",
         responses={200: docs.ok(ob.Batch, "The batch", docs.BATCH),
                    **docs.errors(*docs.COMMON_ERRORS, "batch_not_found")})
    async def retrieve_batch(self, batch_id: str, services: Services, identity: Identity) -> Response[Any]:
        return _json(ob.batch_object(await _owned(services, batch_id, identity.principal)))

    @post("/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch (OpenAI)",
          opt={"scope": credentials.TASKS_WRITE}, after_request=errors_only,
          description="OpenAI's `batches.cancel`: the batch is `cancelling` until its running requests have "
                      "stopped, then `cancelled`; lines that had not run end in the error file "
                      "(`batch_cancelled`). Cancelling a batch that has ended changes nothing.",
          responses={200: docs.ok(ob.Batch, "The batch", docs.BATCH),
                     **docs.errors(*docs.COMMON_ERRORS, "batch_not_found")})
    async def cancel_batch(self, batch_id: str, services: Services, identity: Identity) -> Response[Any]:
        store = _store(services)
        record = await _owned(services, batch_id, identity.principal)
        if await store.move(record.id, ("validating", "in_progress"), "cancelling", cancelling_at=time.time()):
            await store.look_at(record.id, 0)
        return _json(ob.batch_object(await _owned(services, batch_id, identity.principal)))


async def _owned(services: Services, batch_id: str, owner: str) -> BatchRecord:
    record = None if not ids.is_id(batch_id, ids.BATCH) else await _store(services).get(batch_id, owner)
    if record is None:
        raise NotFound(f"Batch {batch_id!r} does not exist.", code="batch_not_found")
    return record


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > ext.MAX_METADATA_PAIRS or any(
            len(key) > ext.MAX_METADATA_KEY or len(value) > ext.MAX_METADATA_VALUE for key, value in metadata.items()):
        raise InvalidRequest("metadata takes at most 16 pairs, keys of at most 64 characters and values of at "
                             "most 512.", code="invalid_request", extra={"param": "metadata"})
