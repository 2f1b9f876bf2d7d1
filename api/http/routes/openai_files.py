"""OpenAI's Files API, for the Batch API's input and output files: ``POST /v1/files``, ``GET
/v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.

Files live in Redis (``lmsp_core.store.objects.files``). Only purpose ``batch`` can be uploaded, as JSONL;
a batch writes its output and error files (purpose ``batch_output``) itself. An upload may be as
large as ``LMSP_MAX_FILE_BYTES``, above the app's body limit ``LMSP_MAX_BODY_BYTES``: the routes
come from ``controller(settings)``, which sets their own limit.
"""

from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.enums import RequestEncodingType
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import Body, Parameter
from litestar.response import Stream

from api.http.openapi import document as doc
from api.http.openapi import openai as docs
from api.http.problems import lmsp_error
from api.openai import PREFIX
from api.openai import files as of
from api.openai.errors import errors_only, unsupported
from api.process import Services
from lmsp_core.settings import Settings
from lmsp_core.store.objects.files import FileRecord, Order
from lmsp_core.store.tenants import credentials
from lmsp_core.wire import ids
from lmsp_core.wire.errors import NotFound

MAX_PAGE = 10_000  # OpenAI's bound of `limit`, and its default
_BATCH_FILE = "\n".join(msgspec.json.encode({
    "custom_id": f"request-{n}", "method": "POST", "url": "/v1/chat/completions",
    "body": {"model": doc.MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}}).decode()
    for n in (1, 2))
# what a multipart form adds around the file's bytes (boundaries, part headers, the purpose): the
# body may exceed the file limit by this much, and the file itself is then checked exactly
FORM_OVERHEAD = 64 * 1024
CONTENT_TYPE = "application/octet-stream"


def _json(value: Any) -> Response[Any]:
    return Response(content=msgspec.json.encode(value), media_type="application/json")


def _body_too_large(request: Request[Any, Any, Any], _: RequestEntityTooLarge) -> Response[bytes]:
    """Litestar's refusal of a body over the route's limit, as the files routes word it."""
    services: Services = request.app.state.services
    return lmsp_error(request, of.too_large(services.settings.max_file_bytes))


class OpenAIFilesController(Controller):
    path = f"{PREFIX}/files"
    tags = ["openai"]
    exception_handlers = {RequestEntityTooLarge: _body_too_large}

    @post(status_code=200, summary="Upload a file (OpenAI)", opt={"scope": credentials.TASKS_WRITE},
          after_request=errors_only,
          description="OpenAI's `files.create`: a `multipart/form-data` upload of `file` with `purpose` `batch` "
                      "(the only purpose accepted), a batch's input: JSONL, each non-blank line a JSON object, at "
                      "most `LMSP_MAX_BATCH_LINES` lines and `LMSP_MAX_FILE_BYTES` bytes (`413 file_too_large`). "
                      "What each line asks for is checked by the batch. Kept `LMSP_FILE_RETENTION` (`expires_at`).",
          responses={200: docs.ok(of.FileObject, "The file", docs.FILE),
                     **docs.errors(*docs.COMMON_ERRORS, "unsupported_parameter", "unsupported_value",
                                   "invalid_file_format", "too_many_lines", "file_too_large")})
    async def create_file(self, data: Annotated[of.FileUpload, Body(media_type=RequestEncodingType.MULTI_PART)],
                          services: Services, owner: str) -> Response[Any]:
        try:
            if data.purpose not in of.UPLOAD_PURPOSES:
                raise unsupported("purpose", f"purpose {data.purpose!r} is not supported: only 'batch' files can be "
                                             "uploaded.")
            content = await data.file.read()
        finally:
            await data.file.close()
        if len(content) > services.settings.max_file_bytes:
            raise of.too_large(services.settings.max_file_bytes)
        lines = of.batch_lines(content, services.settings.max_batch_lines)
        record = await services.files.upload(owner, data.purpose, data.file.filename or "upload.jsonl", content,
                                             lines=lines)
        return _json(of.file_object(record))

    @get(summary="List files (OpenAI)", opt={"scope": credentials.TASKS_READ}, after_request=errors_only,
         description="OpenAI's `files.list`: the caller's files (uploads and batches' output files), newest first "
                     "(`order=desc`, the default) or oldest first, of one `purpose` or all; `after` is the `id` of "
                     "the last file of the previous page (one that is no file of the caller's: `404`).",
         responses={200: docs.ok(of.FileList, "A page of files", docs.FILE_LIST),
                    **docs.errors(*docs.COMMON_ERRORS, "file_not_found")})
    async def list_files(
        self, services: Services, owner: str,
        purpose: Annotated[str | None, Parameter(description="only files of this purpose")] = None,
        limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE, description="files per page")] = MAX_PAGE,
        after: Annotated[str | None, Parameter(description="the `id` of the file to list after")] = None,
        order: Annotated[Order, Parameter(description="by `created_at`; `desc`: the newest first")] = "desc",
    ) -> Response[Any]:
        records, more = await services.files.list(owner, purpose=purpose, limit=limit, after=after, order=order)
        return _json(of.file_list(records, more))

    @get("/{file_id:str}", summary="Retrieve a file (OpenAI)", opt={"scope": credentials.TASKS_READ},
         after_request=errors_only, description="OpenAI's `files.retrieve`: the file object.",
         responses={200: docs.ok(of.FileObject, "The file", docs.FILE),
                    **docs.errors(*docs.COMMON_ERRORS, "file_not_found")})
    async def retrieve_file(self, file_id: str, services: Services, owner: str) -> Response[Any]:
        return _json(of.file_object(await _owned(services, file_id, owner)))

    @get("/{file_id:str}/content", summary="Download a file's content (OpenAI)", opt={"scope": credentials.TASKS_READ},
         after_request=errors_only,
         description="OpenAI's `files.content`: the file's bytes as uploaded or as the batch wrote them, streamed.",
         responses={200: doc.ok(bytes, "The file's content (a batch file: JSONL)",
                                doc.LiteralExample(summary="A batch file", value=_BATCH_FILE),
                                media_type=CONTENT_TYPE),
                    **docs.errors(*docs.COMMON_ERRORS, "file_not_found")})
    async def file_content(self, file_id: str, services: Services, owner: str) -> Stream:
        record = await _owned(services, file_id, owner)
        # the length is known: a download cut short (the file deleted meanwhile) fails visibly
        return Stream(services.files.chunks(record.id), media_type=CONTENT_TYPE,
                      headers={"Content-Length": str(record.bytes)})

    @delete("/{file_id:str}", status_code=200, summary="Delete a file (OpenAI)", opt={"scope": credentials.TASKS_WRITE},
            after_request=errors_only,
            description="OpenAI's `files.delete`: answers `{\"id\", \"object\": \"file\", \"deleted\": true}`; a "
                        "second delete is `404`. A batch made from the file keeps its own copy of the lines.",
            responses={200: docs.ok(of.FileDeleted, "The file was deleted", docs.FILE_DELETED),
                       **docs.errors(*docs.COMMON_ERRORS, "file_not_found")})
    async def delete_file(self, file_id: str, services: Services, owner: str) -> Response[Any]:
        if not ids.is_id(file_id, ids.FILE) or not await services.files.delete(file_id, owner):
            raise _not_found(file_id)
        return _json(of.FileDeleted(id=file_id))


def controller(settings: Settings) -> type[OpenAIFilesController]:
    """The files routes of an app with these settings: a body may carry a file of
    ``LMSP_MAX_FILE_BYTES`` (the app's limit of other bodies is ``LMSP_MAX_BODY_BYTES``)."""

    class SizedFilesController(OpenAIFilesController):
        request_max_body_size = settings.max_file_bytes + FORM_OVERHEAD

    return SizedFilesController


def _not_found(file_id: str) -> NotFound:
    return NotFound(f"File {file_id!r} does not exist.", code="file_not_found")


async def _owned(services: Services, file_id: str, owner: str) -> FileRecord:
    record = await services.files.get(file_id, owner) if ids.is_id(file_id, ids.FILE) else None
    if record is None:
        raise _not_found(file_id)
    return record
