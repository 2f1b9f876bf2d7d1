"""The batch driver: moves every batch from its input file to its output file, in any API process.

Each API process runs one driver. Drivers take due batches from one index in Redis, each held from
the others for a while (``BatchStore.due``), look at each once and put it back with the time of
its next look. A look does one step and every step is safe to repeat, so a driver that dies
mid-step leaves the batch to another once the hold lapses:

- ``validating``: the input file's lines are copied to the batch and checked; a line that is not
  a request of the batch's endpoint ends at once in the error file (by its line number, once).
- ``in_progress``: lines become tasks of the batch's owner at ``low`` priority, at most
  ``LMSP_BATCH_IN_FLIGHT`` unfinished at a time (a task's ``Idempotency-Key`` is the batch and
  line, so a repeated step finds the same task); tasks that ended give their lines' results. A
  full queue or the owner's quota only defers the next lines. At the end of the completion window
  the lines that have not started end ``batch_expired`` (queued tasks are cancelled); a cancel
  ends them ``batch_cancelled`` and cancels the running ones.
- ``finalizing``: the output and error files are written (ids derived from the batch's, so a
  repeat writes nothing new) and the batch ends ``completed``, ``expired`` or ``cancelled``, with a
  ``batch.*`` webhook event.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec
from redis.exceptions import RedisError

from api.background.outage import Outage, poll
from api.openai import batches as lines
from api.process import Services
from api.submission.submit import submit
from lmsp_core import tracing
from lmsp_core.store.objects import batches
from lmsp_core.store.objects.batches import BatchRecord
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire import ids
from lmsp_core.wire.errors import LmspError, ServiceUnavailable, TooManyRequests

logger = logging.getLogger(__name__)

HOLD = 10.0  # seconds a taken batch is left to its driver before another may look (steps are shorter;
# a longer one is only looked at twice, which every step allows)
TAKE = 8  # batches a driver takes at a time
IDLE_POLL = 0.5
IN_PROGRESS_LOOK = 0.5  # seconds between looks at a running batch
WATCH = 2.0  # between looks while the queue is full or the owner at its quota

Emit = Callable[..., Awaitable[object]]  # lmsp_core.store.webhooks.emit, its Redis given


class BatchDriver:
    def __init__(self, services: Services, emit: Emit | None = None) -> None:
        self.services = services
        self.store = batches.BatchStore(services.redis, services.settings.task_retention)
        self.emit = emit

    async def run(self) -> None:
        await poll(self._take, self._look_all, idle=IDLE_POLL, outage=Outage("batch driver", logger))

    async def _take(self) -> list[str]:
        return await self.store.due(TAKE, HOLD)

    async def _look_all(self, due: list[str]) -> None:
        for batch_id in due:
            await self._look_safely(batch_id)

    async def _look_safely(self, batch_id: str) -> None:
        try:
            await self.look(batch_id)
        except (RedisError, OSError):
            raise
        except Exception:  # one batch's fault must not stop the others: it is looked at again later
            logger.exception("batch %s: a step failed; retrying in %s s", batch_id, HOLD)

    async def look(self, batch_id: str) -> None:
        """One step of the batch; then its next look. A batch that has ended is announced (again:
        its webhook event is idempotent) and leaves the index."""
        record = await self.store.get(batch_id)
        if record is None:
            await self.store.forget(batch_id)
            return
        if record.final:
            await self._announce(record, record.status)
            await self.store.forget(batch_id)
            return
        delay = await self._step(record)
        await self.store.look_at(batch_id, delay)

    async def _step(self, record: BatchRecord) -> float:
        if record.status == "validating":
            await self._validate(record)
            return 0
        if record.status == "cancelling" and record.in_progress_at is None and record.total == 0:
            await self._validate(record)  # cancelled while validating: its lines still end, cancelled
            record = await self.store.get(record.id) or record
        if record.status == "finalizing":
            await self._finalize(record)
            return 0
        await self._collect(record)
        record = await self.store.get(record.id) or record
        if record.status == "cancelling":
            await self._stop(record, "batch_cancelled", "The batch was cancelled before this request ran.")
        elif batches.now() >= record.expires_at:
            await self._stop(record, "batch_expired", "The batch's completion window ended before this request ran.")
            await self.store.update(record.id, expired_at=record.expired_at or batches.now())
        elif not await self._start_lines(record):
            return WATCH
        record = await self.store.get(record.id) or record
        if record.started >= record.total and record.ended >= record.total:
            await self.store.move(record.id, ("in_progress", "cancelling"), "finalizing", finalizing_at=batches.now())
            return 0
        return IN_PROGRESS_LOOK

    # --- validating ------------------------------------------------------------------------------

    async def _validate(self, record: BatchRecord) -> None:
        content = await self.services.files.read(record.input_file_id)
        if content is None:
            await self._fail(record, "file_not_found", f"The input file {record.input_file_id} does not exist "
                                                       "(it was deleted or has expired).")
            return
        raw = [line for line in content.split(b"\n") if line.strip()]
        if not raw:
            await self._fail(record, "empty_file", f"The input file {record.input_file_id} has no requests.")
            return
        await self.store.store_lines(record.id, raw)
        seen: set[str] = set()
        for number, text in enumerate(raw):
            try:
                line = lines.parse_line(text, record.endpoint)
                if line.custom_id in seen:
                    raise lines.LineError("duplicate_custom_id", f"custom_id {line.custom_id!r} is used by an "
                                                                 "earlier line.", line.custom_id)
                seen.add(line.custom_id)
            except lines.LineError as exc:
                await self.store.end_line(record.id, number, lines.error_line(record.id, number, exc.custom_id,
                                                                                  exc.code, exc.message), "failed")
        if not await self.store.move(record.id, ("validating",), "in_progress", total=len(raw),
                                     in_progress_at=batches.now()):
            await self.store.update(record.id, total=len(raw))

    async def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        errors = lines.BatchErrors(data=[lines.BatchError(code=code, message=message, param="input_file_id")])
        await self.store.move(record.id, ("validating",), "failed", failed_at=batches.now(),
                              errors=msgspec.json.encode(errors).decode())

    # --- in progress -------------------------------------------------------------------------------

    async def _start_lines(self, record: BatchRecord) -> bool:
        """Start lines while fewer than the in-flight limit are open; False when the queue or the
        owner's quota stopped it (look again later)."""
        room = self.services.settings.batch_in_flight - len(await self.store.open_tasks(record.id))
        line = record.started
        while room > 0 and line < record.total:
            chunk = await self.store.lines(record.id, line, min(record.total, line + room))
            for text in chunk:
                started = await self._start_line(record, line, text)
                if started is None:
                    return False
                room -= started
                line += 1
                await self.store.skip_to(record.id, line)
        return True

    async def _start_line(self, record: BatchRecord, number: int, text: bytes) -> int | None:
        """1 when the line got a task, 0 when it ended (or had ended) without one, None when the
        queue or the quota is full."""
        if await self.store.has_result(record.id, number):
            return 0
        line = lines.parse_line(text, record.endpoint)
        # the line's task joins the batch's trace (its request's), under a span of its own
        span = tracing.start("batch line", record.trace, kind="producer",
                             attributes={"lmsp.batch.id": record.id, "lmsp.batch.line": number})
        try:
            with tracing.active(span):
                request = lines.lmsp_request(line, record.endpoint, self.services.catalog)
                task, _ = await submit(self.services, request, kind="task", owner=record.owner,
                                       idempotency_key=f"{record.id}:{number}", endpoint=f"batch{record.endpoint}",
                                       batch=record.id)
        except (TooManyRequests, ServiceUnavailable):
            return None
        except LmspError as exc:
            span.fail(exc.code)
            result = lines.refused_line(record.id, number, line.custom_id, exc.problem())
            await self.store.end_line(record.id, number, result, "failed")
            return 0
        finally:
            span.end()
        await self.store.started(record.id, number, task.id)
        return 1

    async def _collect(self, record: BatchRecord) -> None:
        """Results of the lines whose task has ended."""
        open_tasks = await self.store.open_tasks(record.id)
        if not open_tasks:
            return
        records = await asyncio.gather(*(self.services.store.get(task_id) for task_id in open_tasks.values()))
        for (number, task_id), task in zip(open_tasks.items(), records, strict=True):
            if task is None:
                await self._lost(record, number, task_id)
            elif task.final:
                await self._ended(record, number, task)

    async def _ended(self, record: BatchRecord, number: int, task: TaskRecord) -> None:
        custom_id = await self._custom_id(record, number)
        if task.status == "cancelled":
            code, why = ("batch_expired", "The batch's completion window ended before this request ran.") \
                if record.expired_at is not None else ("batch_cancelled", "The batch was cancelled.")
            await self.store.end_line(record.id, number, lines.error_line(record.id, number, custom_id, code, why),
                                      "failed")
            return
        result, ok = lines.output_line(record.id, number, custom_id, task, record.endpoint)
        await self.store.end_line(record.id, number, result, "completed" if ok else "failed")

    async def _lost(self, record: BatchRecord, number: int, task_id: str) -> None:
        custom_id = await self._custom_id(record, number)
        result = lines.error_line(record.id, number, custom_id, "task_expired",
                                  f"The task {task_id} of this request has expired.")
        await self.store.end_line(record.id, number, result, "failed")

    async def _custom_id(self, record: BatchRecord, number: int) -> str:
        text = (await self.store.lines(record.id, number, number + 1) or [b"{}"])[0]
        return lines.parse_line(text, record.endpoint).custom_id

    async def _stop(self, record: BatchRecord, code: str, message: str) -> None:
        """Cancel the open lines' queued tasks (running ones too, when cancelling) and end every line
        not started."""
        for task_id in (await self.store.open_tasks(record.id)).values():
            task = await self.services.store.get(task_id)
            if task is None or task.cancel_requested:
                continue
            if task.status == "queued" or (code == "batch_cancelled" and task.status == "in_progress"):
                await self.services.store.cancel(task)
        for number in range(record.started, record.total):
            if not await self.store.has_result(record.id, number):
                custom_id = await self._custom_id(record, number)
                await self.store.end_line(record.id, number,
                                          lines.error_line(record.id, number, custom_id, code, message), "failed")
        await self.store.skip_to(record.id, record.total)

    # --- finalizing --------------------------------------------------------------------------------

    async def _finalize(self, record: BatchRecord) -> None:
        output, errors = await self.store.results(record.id)
        output_id = await self._write(record, "output", output)
        error_id = await self._write(record, "error", errors)
        status: batches.Status = ("cancelled" if record.cancelling_at is not None else
                                  "expired" if record.expired_at is not None else "completed")
        await self.store.move(record.id, ("finalizing",), status, output_file_id=output_id, error_file_id=error_id,
                              **{f"{status}_at": batches.now()})

    async def _write(self, record: BatchRecord, part: str, content: list[bytes]) -> str | None:
        if not content:
            return None
        file_id = ids.derived_id("file", f"{record.id}:{part}")
        await self.services.files.create(record.owner, "batch_output", f"{record.id}_{part}.jsonl",
                                         b"\n".join(content) + b"\n", lines=len(content), file_id=file_id)
        return file_id

    async def _announce(self, record: BatchRecord, status: str) -> None:
        if self.emit is None:
            return
        with contextlib.suppress(RedisError):
            await self.emit(record.owner, f"batch.{status}", {"id": record.id}, f"evt_{record.id}_{status}",
                            trace=record.trace)
