"""``lmsp batch create|wait|list|show|cancel``: OpenAI batches, many requests from one JSONL file.

``create`` uploads the file, creates the batch and waits for it with a progress bar on stderr (a
plain line per change when stderr is not a terminal), then saves the output and error files next to
the input. The batch runs in the service, not in the command: Ctrl-C stops waiting and leaves it
running (``lmsp batch show ID``, ``lmsp batch wait ID``).
"""

import sys
import time
from pathlib import Path
from typing import NamedTuple, TextIO

from lmsp.client import Batch, BatchResult, Client, LmspClientError
from lmsp.client.batches import RequestCounts
from lmsp.clientcommands import terminal

BAR_WIDTH = 30
TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")


class Paths(NamedTuple):
    """Where a batch's output and error files are saved."""

    output: Path
    errors: Path

    @classmethod
    def beside(cls, source: Path, output: Path | None, errors: Path | None) -> "Paths":
        """``--output``/``--errors``, else ``<stem>.output.jsonl`` and ``<stem>.errors.jsonl`` next to
        ``source``."""
        stem = source.name.removesuffix(".jsonl")
        return cls(output or source.with_name(f"{stem}.output.jsonl"),
                   errors or source.with_name(f"{stem}.errors.jsonl"))


class BatchProgress:
    """``on_progress`` of waiting for a batch: a bar rewritten in place on a terminal, else a line a change."""

    def __init__(self, err: TextIO | None = None) -> None:
        self.err = err or sys.stderr
        self.tty = self.err.isatty()
        self._open_line = False

    def __call__(self, batch: Batch) -> None:
        counts = batch.request_counts
        if self.tty:
            self.err.write(f"\r\033[K{bar(counts)} {counts.done}/{counts.total} {batch.status}")
            self._open_line = True
        else:
            self.err.write(f"{batch.id} {batch.status}: {counts.done}/{counts.total} done, {counts.failed} failed\n")
        self.err.flush()

    def end(self) -> None:
        if self._open_line:
            self.err.write("\n")
            self.err.flush()
            self._open_line = False


def bar(counts: RequestCounts, width: int = BAR_WIDTH) -> str:
    filled = width * counts.done // counts.total if counts.total else 0
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def create(client: Client, source: Path, endpoint: str, window: str, paths: Paths, wait: bool) -> int:
    """Upload ``source``, create its batch and, with ``wait``, follow it to the end and save its files."""
    try:
        uploaded = client.files.upload(source, purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=window)
    except LmspClientError as exc:
        return terminal.report(exc)
    except OSError as exc:
        terminal.error("unreadable_file", str(exc))
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted before the batch was created\n")
        return 130
    sys.stderr.write(f"batch {batch.id} (lmsp batch show {batch.id})\n")
    if not wait:
        sys.stdout.write(f"{batch.id} {batch.status}\n")
        return 0
    return follow(client, batch.id, paths)


def follow(client: Client, batch_id: str, paths: Paths) -> int:
    """Wait for the batch with a progress display, save its files, print its counts; 0 when it completed."""
    progress = BatchProgress()
    try:
        result = client.batches.results(client.batches.wait(batch_id, on_progress=progress))
    except LmspClientError as exc:
        progress.end()
        return terminal.report(exc)
    except KeyboardInterrupt:
        progress.end()
        sys.stderr.write(f"\nstopped waiting; the batch goes on: lmsp batch show {batch_id}\n"
                         f"to save its files when it ends: lmsp batch wait {batch_id} --output {paths.output} "
                         f"--errors {paths.errors}\n")
        return 130
    progress.end()
    return finish(result, paths)


def finish(result: BatchResult, paths: Paths) -> int:
    batch = result.batch
    counts = batch.request_counts
    sys.stdout.write(f"{batch.id} {batch.status}: {counts.completed} completed, {counts.failed} failed "
                     f"of {counts.total}\n")
    for name, content, path in (("output", result.output, paths.output), ("errors", result.errors, paths.errors)):
        if content:
            path.write_bytes(content)
            sys.stdout.write(f"{name}: {path}\n")
    for problem in batch.errors.data if batch.errors else []:
        where = f" (line {problem.line})" if problem.line is not None else ""
        terminal.error(problem.code or "batch_error", problem.message + where)
    return 0 if batch.status == "completed" else 1


def list_batches(client: Client, limit: int, everything: bool) -> int:
    rows = [["ID", "STATUS", "ENDPOINT", "DONE", "FAILED", "CREATED"]]
    after = None
    try:
        while True:
            page = client.batches.list(limit=min(limit, 100), after=after)
            for batch in page.data:
                counts = batch.request_counts
                rows.append([batch.id, batch.status, batch.endpoint, f"{counts.done}/{counts.total}",
                             str(counts.failed), when(batch.created_at)])
            if not (everything and page.has_more and page.data):
                break
            after = page.data[-1].id
    except LmspClientError as exc:
        return terminal.report(exc)
    terminal.table(rows)
    return 0


def show(client: Client, batch_id: str) -> int:
    """One line per field: what the batch ran, its counts, its files, when each step happened."""
    try:
        batch = client.batches.get(batch_id)
    except LmspClientError as exc:
        return terminal.report(exc)
    terminal.table(fields(batch))
    return 0


def fields(batch: Batch) -> list[list[str]]:
    counts = batch.request_counts
    rows = [["id", batch.id], ["status", batch.status], ["endpoint", batch.endpoint],
            ["input_file_id", batch.input_file_id], ["completion_window", batch.completion_window],
            ["requests", f"{counts.total} total, {counts.completed} completed, {counts.failed} failed"],
            ["output_file_id", batch.output_file_id or "-"], ["error_file_id", batch.error_file_id or "-"]]
    rows += [[name, when(at)] for name in TIMESTAMPS if (at := getattr(batch, name))]
    if batch.metadata:
        rows.append(["metadata", ", ".join(f"{key}={value}" for key, value in batch.metadata.items())])
    rows += [["error", f"{problem.code}: {problem.message}"] for problem in (batch.errors.data if batch.errors else [])]
    return rows


def cancel(client: Client, batch_id: str) -> int:
    try:
        batch = client.batches.cancel(batch_id)
    except LmspClientError as exc:
        return terminal.report(exc)
    sys.stdout.write(f"{batch.id} {batch.status}\n")
    return 0


def when(timestamp: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
