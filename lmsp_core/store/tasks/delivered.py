"""What a task's events delivered: its output items, for a response that ends before finishing them.

A generation that fails after its stream announced items (``response.output_item.added``) and
streamed their text keeps them in the failed response's ``output`` (and in ``response.failed``):
each item as its ``response.output_item.done`` gave it, or, for one that never got that event, as
announced with the text its deltas carried and ``status: "incomplete"`` (docs/protocol.md). So the
final object holds exactly what the stream delivered, never text that was generated but not sent.

The worker feeds every event it writes (and, for a resumed task, the stored log) through one fold;
a task given up after losing its workers folds its stored log.
"""

from collections.abc import Iterable
from typing import Any

import msgspec

from lmsp_core import wire
from lmsp_core.store.tasks.eventlog import Event


class DeliveredOutput:
    """Output items as a series of events leaves them."""

    def __init__(self) -> None:
        self._items: dict[int, wire.OutputItem] = {}  # by output index: as announced, then as done
        self._done: set[int] = set()
        self._texts: dict[str, list[str]] = {}  # item id -> its deltas (message text, reasoning summary)
        self._logprobs: dict[str, list[wire.TokenLogprob]] = {}  # item id -> its deltas' log-probabilities

    def add(self, name: str, data: Any) -> None:
        """One event: its name and its wire Struct."""
        if isinstance(data, wire.OutputItemAdded):
            self._items[data.output_index] = data.item
        elif isinstance(data, wire.OutputTextDelta | wire.ReasoningSummaryTextDelta):
            self._texts.setdefault(data.item_id, []).append(data.delta)
            if isinstance(data, wire.OutputTextDelta) and data.logprobs:
                self._logprobs.setdefault(data.item_id, []).extend(data.logprobs)
        elif isinstance(data, wire.OutputItemDone):
            self._items[data.output_index] = data.item
            self._done.add(data.output_index)

    def add_stored(self, events: Iterable[Event]) -> None:
        """Events as stored (JSON data)."""
        for event in events:
            kind = _TYPES.get(event.name)
            if kind is not None:
                self.add(event.name, msgspec.json.decode(event.data, type=kind))

    def items(self) -> list[wire.OutputItem]:
        """The items in output order; those without their ``done`` event are ``incomplete``."""
        return [item if index in self._done else self._cut_short(item)
                for index, item in sorted(self._items.items())]

    def logprobs(self, item_id: str) -> list[wire.TokenLogprob]:
        """The log-probabilities a message's deltas carried (none where they were not asked for)."""
        return list(self._logprobs.get(item_id, ()))

    def _cut_short(self, item: wire.OutputItem) -> wire.OutputItem:
        text = "".join(self._texts.get(item.id, ()))
        if isinstance(item, wire.OutputMessage):
            logprobs = self._logprobs.get(item.id)
            part = wire.OutputTextPart(text=text, logprobs=logprobs if logprobs is not None else msgspec.UNSET)
            return msgspec.structs.replace(item, content=[part], status="incomplete")
        if isinstance(item, wire.OutputReasoning):
            return msgspec.structs.replace(item, summary=[wire.SummaryTextPart(text=text)] if text else [],
                                           status="incomplete")
        return msgspec.structs.replace(item, status="incomplete")


_TYPES: dict[str, type[Any]] = {
    wire.ITEM_ADDED: wire.OutputItemAdded,
    wire.TEXT_DELTA: wire.OutputTextDelta,
    wire.REASONING_DELTA: wire.ReasoningSummaryTextDelta,
    wire.ITEM_DONE: wire.OutputItemDone,
}
