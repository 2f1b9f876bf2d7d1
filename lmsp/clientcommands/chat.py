"""``lmsp chat``: an interactive, multi-turn conversation.

Where the model has the ``conversations`` capability (``GET /lmsp/v1/models``), each turn is
stored (``store: true``) and the next one continues it with ``previous_response_id``, sending only
the new message. Otherwise the command keeps the conversation itself and sends the full context
every turn (6.1: the HTTP connection never holds conversation state). ``/reset`` starts over,
``/exit`` or end of input (Ctrl-D) leaves.
"""

import sys
from typing import Any

from lmsp.client import Client, LmspClientError
from lmsp.client.common import user_message
from lmsp.clientcommands import terminal
from lmsp_core import wire


class Conversation:
    def __init__(self, client: Client, model: str, system: str | None, **options: Any) -> None:
        self.client = client
        self.model = model
        self.options = options
        self.system = system
        self.stored = "conversations" in client.models.get(model).capabilities
        self.history: list[wire.InputItem] = []
        self.previous: str | None = None
        self.reset()

    def reset(self) -> None:
        self.previous = None
        self.history = [wire.Message(role="system", content=[wire.InputText(text=self.system)])] if self.system else []

    def turn(self, text: str, progress: terminal.Progress) -> None:
        message = user_message(text)
        if self.stored:
            items = [*self.history, message] if self.previous is None else [message]
            options = {**self.options, "store": True, "previous_response_id": self.previous}
        else:
            items = [*self.history, message]
            options = self.options
        stream = self.client.responses.stream(model=self.model, input=items, **options)
        response_id = None
        for event in stream:
            if isinstance(event.data, wire.ResponseCreated):
                response_id = event.data.response_id
            progress.on_event(event)
        if progress.final is None or progress.final.name not in (wire.COMPLETED, wire.INCOMPLETE):
            return  # a failed or cancelled turn is not part of the conversation
        if self.stored:
            self.previous = response_id
            self.history = []
        else:
            answer = wire.Message(role="assistant", content=[wire.OutputText(text=stream.text)])
            self.history += [message, answer]


def chat(client: Client, model: str, system: str | None = None, **options: Any) -> int:
    try:
        conversation = Conversation(client, model, system, **options)
    except LmspClientError as exc:
        return terminal.report(exc)
    interactive = sys.stdin.isatty()
    if interactive:
        mode = "previous_response_id" if conversation.stored else "full context each turn"
        sys.stderr.write(f"chatting with {model} ({mode}); /reset starts over, /exit or Ctrl-D leaves\n")
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            sys.stderr.write("\n" if interactive else "")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            conversation.reset()
            continue
        progress = terminal.Progress()
        try:
            conversation.turn(text, progress)
        except LmspClientError as exc:
            terminal.report(exc)
            continue
        except KeyboardInterrupt:
            sys.stderr.write("\n[interrupted]\n")
            continue
        progress.finish()
