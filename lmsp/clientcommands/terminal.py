"""What the client commands print: text on stdout, everything else (queue position, token rate,
errors) on stderr, so that ``lmsp run ... > answer.txt`` keeps only the answer."""

import sys
import time
from typing import TextIO

from lmsp.client import Event, LmspClientError
from lmsp.client.errors import APIStatusError
from lmsp_core import wire


class Progress:
    """Tracks one generation: queue notices, deltas and the final usage; reports on ``err``."""

    def __init__(self, err: TextIO | None = None, out: TextIO | None = None) -> None:
        self.err = err or sys.stderr
        self.out = out or sys.stdout
        self.started = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.ended_with_newline = True
        self.final: Event | None = None
        self._waiting_line = False
        self.deltas = 0

    def on_event(self, event: Event) -> None:
        if event.name == wire.QUEUED and isinstance(event.data, wire.TaskQueued):
            self._queued(event.data.queue_position)
        elif event.delta:
            self._text(event.delta)
        elif event.final:
            self.final = event

    def _queued(self, position: int | None) -> None:
        if position is None:
            return
        if self.err.isatty():
            self.err.write(f"\rqueued: position {position}   ")
            self._waiting_line = True
        else:
            self.err.write(f"queued: position {position}\n")
        self.err.flush()

    def _text(self, delta: str) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            if self._waiting_line:
                self.err.write("\r\033[K")
                self.err.flush()
        self.last = now
        self.deltas += 1
        self.out.write(delta)
        self.out.flush()
        self.ended_with_newline = delta.endswith("\n")

    def summary(self) -> str:
        """``64 tokens in 4.1 s, 15.6 tok/s, first token after 0.3 s, prompt 40 tokens``."""
        usage = getattr(self.final.data, "usage", None) if self.final else None
        parts = []
        if isinstance(usage, wire.Usage):
            # the rate of what this command saw arrive (a resumed stream replays part of it at once)
            span = (self.last or self.started) - (self.first or self.started)
            rate = f", {(self.deltas - 1) / span:.1f} tok/s" if span > 0 and self.deltas > 1 else ""
            parts.append(f"{usage.output_tokens} tokens in {time.monotonic() - self.started:.1f} s{rate}")
            if self.first is not None:
                parts.append(f"first token after {self.first - self.started:.2f} s")
            parts.append(f"prompt {usage.input_tokens} tokens")
        if self.final is not None and isinstance(self.final.data, wire.ResponseIncomplete):
            parts.append(f"stopped: {self.final.data.incomplete_details.reason}")
        elif self.final is not None and self.final.name != wire.COMPLETED:
            parts.append(self.final.name.removeprefix("response."))
        return ", ".join(parts)

    def finish(self) -> int:
        """End the output line, print the summary; the exit status (1 unless completed or incomplete)."""
        if not self.ended_with_newline:
            self.out.write("\n")
            self.out.flush()
        self.err.write(f"[{self.summary()}]\n")
        self.err.flush()
        if self.final is not None and isinstance(self.final.data, wire.ResponseFailed):
            error(self.final.data.error.code, self.final.data.error.detail, self.err)
        return 0 if self.final is not None and self.final.name in (wire.COMPLETED, wire.INCOMPLETE) else 1


def error(code: str, detail: str, err: TextIO | None = None) -> None:
    (err or sys.stderr).write(f"error: {code}: {detail}\n")


def report(exc: LmspClientError) -> int:
    """Print a client error on stderr; the exit status."""
    if isinstance(exc, APIStatusError):
        error(exc.code, exc.problem.detail)
    else:
        error("connection", str(exc))
    return 1


def table(rows: list[list[str]], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")
