"""The task object of the tasks API (docs/protocol.md) and a page of them."""

from typing import Literal

from msgspec import UNSET, Struct, UnsetType

from lmsp_core.wire.responses import Problem, Response

TaskStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


class Task(Struct, frozen=True, kw_only=True):
    """The task object (tasks API; see docs/protocol.md)."""

    id: str
    object: Literal["task"] = "task"
    status: TaskStatus
    created_at: int
    started_at: int | None = None
    finished_at: int | None = None
    model: str
    response_id: str
    response: Response | None = None
    error: Problem | None = None
    metadata: dict[str, str] | UnsetType = UNSET  # the request's x-metadata, only where it had some
    batch_id: str | UnsetType = UNSET  # the batch (OpenAI's Batch API) whose line it runs, if any


class TaskList(Struct, frozen=True, kw_only=True):
    """A page of ``GET /lmsp/v1/tasks``: newest first; ``next_cursor`` asks for the next page."""

    object: Literal["list"] = "list"
    data: list[Task]
    has_more: bool = False
    next_cursor: str | None = None
