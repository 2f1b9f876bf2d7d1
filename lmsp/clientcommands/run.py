"""``lmsp run "prompt"``: stream one answer to the terminal.

Direct by default (the answer belongs to the connection: Ctrl-C stops the generation). With
``--task`` the prompt becomes a task that runs on its own: the command follows its events,
reconnecting by itself after a dropped connection, shows the queue position while it waits, and
Ctrl-C leaves the task running (``lmsp tasks follow ID`` picks it up again).
"""

import sys
from typing import Any

from lmsp.client import Client, LmspClientError
from lmsp.clientcommands import terminal


def prompt_text(words: list[str]) -> str:
    text = " ".join(words)
    if not text or text == "-":
        text = sys.stdin.read()
    return text


def run(client: Client, model: str, prompt: str, *, task: bool, **options: Any) -> int:
    progress = terminal.Progress()
    try:
        if task:
            created = client.tasks.create(model=model, input=prompt, **options)
            sys.stderr.write(f"task {created.id} (lmsp tasks follow {created.id})\n")
            follow = client.tasks.events(created.id, queue_events=True)
            try:
                for event in follow:
                    progress.on_event(event)
            except KeyboardInterrupt:
                sys.stderr.write(f"\nstopped following; the task goes on: lmsp tasks follow {created.id}\n")
                return 130
            if follow.expired and follow.task is not None:
                return follow_result(follow.task, follow.text)
        else:
            for event in client.responses.stream(model=model, input=prompt, **options):
                progress.on_event(event)
    except LmspClientError as exc:
        if progress.first is not None:
            sys.stdout.write("\n")
        return terminal.report(exc)
    return progress.finish()


def follow_result(task: Any, shown: str) -> int:
    """Print what a stream could not deliver (its events expired) from the task's final result."""
    text = ""
    if task.response is not None:
        text = "".join(part.text for item in task.response.output for part in getattr(item, "content", []))
    sys.stdout.write(text[len(shown):] if text.startswith(shown) else text)
    sys.stdout.write("\n")
    sys.stderr.write(f"[events expired; final result: {task.status}]\n")
    return 0 if task.status in ("completed", "incomplete") else 1
