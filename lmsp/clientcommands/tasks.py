"""``lmsp tasks list|show|cancel|follow``: the caller's tasks."""

import sys
import time

import msgspec

from lmsp.client import Client, LmspClientError
from lmsp.clientcommands import terminal
from lmsp.clientcommands.run import follow_result
from lmsp_core import wire


def preview(task: wire.Task, width: int = 48) -> str:
    if task.response is None:
        return ""
    text = "".join(part.text for item in task.response.output if isinstance(item, wire.OutputMessage)
                   for part in item.content)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def list_tasks(client: Client, limit: int, everything: bool) -> int:
    rows = [["ID", "STATUS", "MODEL", "CREATED", "OUTPUT"]]
    cursor = None
    try:
        while True:
            page = client.tasks.list(limit=min(limit, 100), cursor=cursor)
            for task in page.data:
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(task.created_at))
                rows.append([task.id, task.status, task.model, created, preview(task)])
            if not (everything and page.has_more):
                break
            cursor = page.next_cursor
    except LmspClientError as exc:
        return terminal.report(exc)
    terminal.table(rows)
    return 0


def show(client: Client, task_id: str) -> int:
    try:
        task = client.tasks.get(task_id)
    except LmspClientError as exc:
        return terminal.report(exc)
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(task), indent=2).decode() + "\n")
    return 0


def cancel(client: Client, task_id: str) -> int:
    try:
        task = client.tasks.cancel(task_id)
    except LmspClientError as exc:
        return terminal.report(exc)
    sys.stdout.write(f"{task.id} {task.status}\n")
    return 0


def follow(client: Client, task_id: str, after: int) -> int:
    """Stream a task's text from event ``after`` on (0: from the start), resuming by itself."""
    progress = terminal.Progress()
    events = client.tasks.events(task_id, after=after, queue_events=True)
    try:
        for event in events:
            progress.on_event(event)
    except LmspClientError as exc:
        return terminal.report(exc)
    except KeyboardInterrupt:
        sys.stderr.write(f"\nstopped after event {events.last_event_id}: lmsp tasks follow {task_id} "
                         f"--after {events.last_event_id}\n")
        return 130
    if events.expired and events.task is not None:
        return follow_result(events.task, events.text)
    return progress.finish()
