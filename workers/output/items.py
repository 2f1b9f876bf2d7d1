"""Decoded text -> LMSP output items and their events.

A reasoning model's output may start with a ``reasoning`` item, whose summary text streams as
``response.reasoning_summary_text.delta`` events. The answer's text is either a message (free
text, or JSON under ``json_schema``) or a series of tool calls in the service's call format
(``lmsp_core.requests.grammars``). With ``tool_choice: auto`` the first characters decide: the grammar
forbids text that starts like a call, so a text that begins with a prefix of the call tag is held
back until it is clearly one or the other.
"""

import json
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from lmsp_core import wire
from lmsp_core.requests.grammars import CALL_CLOSE, CALL_OPEN
from lmsp_core.wire import ids

Mode = Literal["text", "calls", "auto"]
OutEvent = tuple[str, Any]  # an event's name and its wire Struct


class OutputAssembler:
    """Builds the output items from decoded text; the events they cause wait in ``take()``."""

    def __init__(self, response_id: str, mode: Mode, known: Sequence[wire.OutputItem] = (),
                 logprobs: bool = False) -> None:
        """``logprobs``: the message's text part carries its tokens' log-probabilities (``add_logprobs``)."""
        self.response_id = response_id
        self._events: list[OutEvent] = []
        self.mode: Mode = mode
        self.known = list(known)  # items a previous run announced: their ids are reused on resume
        self.items: list[wire.OutputItem] = []
        self._message: wire.OutputMessage | None = None
        self._text: list[str] = []
        self._reasoning: wire.OutputReasoning | None = None
        self._summary: list[str] = []
        self._pending = ""  # text not yet turned into events (an undecided prefix, an unfinished call)
        self._logprobs: list[wire.TokenLogprob] | None = [] if logprobs else None  # the message's tokens'

    def take(self) -> list[OutEvent]:
        """The events caused since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def emit(self, name: str, data: Any) -> None:
        self._events.append((name, data))

    def start(self) -> None:
        if self.mode == "text":
            self._open_message()

    def feed(self, text: str) -> None:
        if not text:
            return
        if self.mode == "text":
            self._add_text(text)
            return
        self._pending += text
        if self.mode == "auto":
            if self._pending.startswith(CALL_OPEN):
                self.mode = "calls"
            elif CALL_OPEN.startswith(self._pending):
                return  # still undecided
            else:
                self.mode = "text"
                text, self._pending = self._pending, ""
                self._open_message()
                self._add_text(text)
                return
        self._take_calls()

    @property
    def message_id(self) -> str | None:
        """The open message's id (None while none is open)."""
        return self._message.id if self._message is not None else None

    def add_logprobs(self, entries: Sequence[wire.TokenLogprob]) -> None:
        """Log-probabilities of the message's tokens, in order (those before a resume first)."""
        if self._logprobs is not None:
            self._logprobs += entries

    def open_reasoning(self) -> None:
        item_id, _ = self._next_id(ids.REASONING)
        self._reasoning = wire.OutputReasoning(id=item_id)
        self.items.append(self._reasoning)
        self.emit(wire.ITEM_ADDED, wire.OutputItemAdded(response_id=self.response_id,
                                                        output_index=len(self.items) - 1, item=self._reasoning))

    def add_reasoning(self, text: str) -> None:
        assert self._reasoning is not None
        self._summary.append(text)
        self.emit(wire.REASONING_DELTA, wire.ReasoningSummaryTextDelta(
            response_id=self.response_id, item_id=self._reasoning.id, delta=text))

    def close_reasoning(self) -> None:
        if self._reasoning is None:
            return
        text = "".join(self._summary)
        item = wire.OutputReasoning(id=self._reasoning.id,
                                    summary=[wire.SummaryTextPart(text=text)] if text else [])
        index = self.items.index(self._reasoning)
        self.items[index] = item
        self.emit(wire.ITEM_DONE, wire.OutputItemDone(response_id=self.response_id, output_index=index, item=item))
        self._reasoning = None

    def finish(self) -> list[wire.OutputItem]:
        """Close the open items; an unfinished call (the token budget ran out) is dropped."""
        self.close_reasoning()
        if self._message is not None:
            part = wire.OutputTextPart(text="".join(self._text),
                                       logprobs=self._logprobs if self._logprobs is not None else msgspec.UNSET)
            item = wire.OutputMessage(id=self._message.id, content=[part])
            self.items[-1] = item
            self.emit(wire.ITEM_DONE, wire.OutputItemDone(response_id=self.response_id,
                                                          output_index=len(self.items) - 1, item=item))
            self._message = None
        return self.items

    # --- internals -----------------------------------------------------------------------------

    def _next_id(self, prefix: str) -> tuple[str, wire.OutputItem | None]:
        known = self.known[len(self.items)] if len(self.items) < len(self.known) else None
        return (known.id if known is not None else ids.new_id(prefix)), known

    def _open_message(self) -> None:
        item_id, _ = self._next_id(ids.MESSAGE)
        self._message = wire.OutputMessage(id=item_id)
        self.items.append(self._message)
        self.emit(wire.ITEM_ADDED, wire.OutputItemAdded(response_id=self.response_id,
                                                        output_index=len(self.items) - 1, item=self._message))

    def _add_text(self, text: str) -> None:
        assert self._message is not None
        self._text.append(text)
        self.emit(wire.TEXT_DELTA, wire.OutputTextDelta(response_id=self.response_id, item_id=self._message.id,
                                                        delta=text))

    def _take_calls(self) -> None:
        while (end := self._pending.find(CALL_CLOSE)) >= 0:
            body = self._pending[self._pending.index(CALL_OPEN) + len(CALL_OPEN):end]
            self._pending = self._pending[end + len(CALL_CLOSE):]
            self._add_call(json.loads(body))

    def _add_call(self, call: dict[str, Any]) -> None:
        item_id, known = self._next_id(ids.FUNCTION_CALL)
        call_id = known.call_id if isinstance(known, wire.OutputFunctionCall) else ids.new_id(ids.CALL)
        arguments = json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":"))
        announced = wire.OutputFunctionCall(id=item_id, call_id=call_id, name=call["name"], arguments="")
        item = wire.OutputFunctionCall(id=item_id, call_id=call_id, name=call["name"], arguments=arguments)
        self.items.append(item)
        index = len(self.items) - 1
        self.emit(wire.ITEM_ADDED, wire.OutputItemAdded(response_id=self.response_id, output_index=index,
                                                        item=announced))
        self.emit(wire.ITEM_DONE, wire.OutputItemDone(response_id=self.response_id, output_index=index, item=item))
