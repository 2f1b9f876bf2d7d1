"""OpenAI's file objects and uploads (``/v1/files``, the SDK's ``files``): the shapes of
``FileObject``, ``FileDeleted`` and the list page, the multipart form of an upload, and the check
that an upload of purpose ``batch`` is JSONL.

Only the file's shape is checked here: each non-blank line one JSON object. What a line asks for
(``custom_id``, ``method``, ``url``, ``body``) is the batch's to check, line by line, as OpenAI does.
"""

from typing import Annotated, Literal

import msgspec
from litestar.datastructures import UploadFile

from lmsp_core.store.objects.files import FileRecord
from lmsp_core.wire.errors import ContentTooLarge, InvalidRequest

UPLOAD_PURPOSES = ("batch",)  # "batch_output" files are written by batches only


class FileObject(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"  # deprecated by OpenAI; a stored file is processed
    expires_at: int | None = None
    status_details: str | None = None


class FileList(msgspec.Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileUpload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The form of ``POST /v1/files`` (``multipart/form-data``), as ``files.create(file=..., purpose=...)``
    sends it."""

    file: Annotated[UploadFile, msgspec.Meta(extra_json_schema={
        "type": "string", "format": "binary", "contentMediaType": "application/jsonl",
        "description": "JSONL: each non-blank line a JSON object (a batch's request)"})]
    purpose: Annotated[str, msgspec.Meta(extra_json_schema={"enum": list(UPLOAD_PURPOSES)})]


def file_object(record: FileRecord) -> FileObject:
    return FileObject(id=record.id, bytes=record.bytes, created_at=record.created_at, filename=record.filename,
                      purpose=record.purpose, expires_at=record.expires_at)


def file_list(records: list[FileRecord], has_more: bool) -> FileList:
    data = [file_object(record) for record in records]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=has_more)


def too_large(limit: int) -> ContentTooLarge:
    return ContentTooLarge(f"The file is larger than this service accepts ({limit} bytes).",
                           extra={"param": "file"})


class _JsonObject(msgspec.Struct):
    """Any JSON object: decoding into it checks a line's JSON without building it."""


def batch_lines(data: bytes, max_lines: int) -> int:
    """The requests of a batch input file, its non-blank lines; ``400 invalid_file_format`` naming the
    first line that is not UTF-8 JSON object, ``400 too_many_lines`` above ``max_lines``."""
    count = 0
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        count += 1
        if count > max_lines:
            raise InvalidRequest(f"The file has more than {max_lines} requests (non-blank lines); split it into "
                                 "several batches.", code="too_many_lines", extra={"param": "file"})
        try:
            line.decode()
            msgspec.json.decode(line, type=_JsonObject)
        except UnicodeDecodeError:
            raise _invalid(f"Line {number} of the file is not UTF-8.") from None
        except msgspec.ValidationError:
            raise _invalid(f"Line {number} of the file is not a JSON object.") from None
        except msgspec.DecodeError as exc:
            raise _invalid(f"Line {number} of the file is not JSON: {exc}.") from None
    if not count:
        raise _invalid("The file has no requests: a batch input file is JSONL, one request a line.")
    return count


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="invalid_file_format", extra={"param": "file"})
