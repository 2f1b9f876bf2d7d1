"""OpenAI's Files and Batch API as the client reads them (``/v1/files``, ``/v1/batches``), and what the
sync and async clients share about them: the upload form, the request bodies, waiting for a batch.
No network I/O here.

The objects are decoded leniently: fields this client does not know are ignored, missing optional
ones take their defaults, so a newer service (or OpenAI's) still reads."""

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from lmsp.client.common import RESUMABLE_STATUSES, Reconnects
from lmsp.client.errors import APIConnectionError, APIStatusError

FILES = "/v1/files"
BATCHES = "/v1/batches"
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
JSONL = "application/jsonl"


class FileObject(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    bytes: int = 0
    created_at: int = 0
    filename: str = ""
    purpose: str = ""
    expires_at: int | None = None


class RequestCounts(msgspec.Struct, frozen=True, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0

    @property
    def done(self) -> int:
        return self.completed + self.failed


class BatchError(msgspec.Struct, frozen=True, kw_only=True):
    code: str | None = None
    message: str = ""
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct, frozen=True, kw_only=True):
    data: list[BatchError] = msgspec.field(default_factory=list)


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    """A batch; its ``*_at`` are Unix times, None until the batch gets there."""

    id: str
    status: str
    endpoint: str = ""
    input_file_id: str = ""
    completion_window: str = ""
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    metadata: dict[str, str] | None = None
    created_at: int = 0
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL_STATUSES


class BatchList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[Batch]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class BatchResult(NamedTuple):
    """What ``batches.run`` gives: the final batch, the output file's lines and the error file's
    (``b""`` where the batch has none)."""

    batch: Batch
    output: bytes
    errors: bytes


FileSource = str | os.PathLike[str] | bytes
Progress = Callable[[Batch], None]


def upload_form(source: FileSource, purpose: str, filename: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The multipart ``files`` and ``data`` of ``POST /v1/files``: a path's content under its name,
    or bytes under ``filename`` (default ``input.jsonl``)."""
    if isinstance(source, bytes):
        content, name = source, filename or "input.jsonl"
    else:
        with open(source, "rb") as handle:
            content = handle.read()
        name = filename or os.path.basename(os.fspath(source))
    return {"file": (name, content, JSONL)}, {"purpose": purpose}


def create_body(input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, str] | None) -> bytes:
    fields: dict[str, Any] = {"input_file_id": input_file_id, "endpoint": endpoint,
                              "completion_window": completion_window}
    if metadata is not None:
        fields["metadata"] = metadata
    return msgspec.json.encode(fields)


def list_params(limit: int, after: str | None) -> dict[str, Any]:
    return {"limit": limit} | ({"after": after} if after else {})


def file_path(file_id: str) -> str:
    return f"{FILES}/{file_id}"


def batch_path(batch_id: str) -> str:
    return f"{BATCHES}/{batch_id}"


class Watch:
    """Waiting for a batch to end: reports each change of its status or counts to ``on_progress``
    and rides out a service that is away for a while (a dropped connection, 502/503/504), as task
    event streams do (``Reconnects``)."""

    def __init__(self, on_progress: Progress | None, reconnects: Reconnects | None = None) -> None:
        self.on_progress = on_progress
        self.reconnects = reconnects or Reconnects(max_delay=30.0)
        self._last: tuple[str, RequestCounts] | None = None

    def seen(self, batch: Batch) -> bool:
        """Note a polled batch; whether it is final."""
        self.reconnects.progressed()
        state = (batch.status, batch.request_counts)
        if state != self._last:
            self._last = state
            if self.on_progress is not None:
                self.on_progress(batch)
        return batch.final

    def failed(self, error: Exception) -> float:
        """The delay before the next poll after a failed one (at least what a 429 asks for); raises
        ``error`` when it is not transient or the service stayed away too long."""
        status = error.status if isinstance(error, APIStatusError) else None
        transient = isinstance(error, APIConnectionError) or status in RESUMABLE_STATUSES or status == 429
        delay = self.reconnects.next_delay() if transient else None
        if delay is None:
            raise error
        asked = error.retry_after if isinstance(error, APIStatusError) else None
        return max(delay, asked or 0.0)
