"""What one model step is asked to do, and the model that does it: the engine's side of the model.

Every running sequence owns a KV slot of the model (``workers.model.kvcache``). A step
(``StepPlan``) feeds one token to each decoding sequence and chunks of prompts to sequences that are
joining; a ``SlotModel`` runs it on its slots and returns the logits asked for.
"""

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from torch import Tensor


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens of one slot, written at positions ``start, start+1, ...``."""

    slot: int
    start: int
    tokens: list[int]
    last: bool  # the prompt's last chunk: the logits of its last position are wanted

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


FED = -1  # a feed's token while the step is given every feed's token on the device (``SlotModel.run``)


class Feed(NamedTuple):
    """One decoding sequence's next token, at ``position`` of its slot (a tuple: a step makes one a
    sequence, and a tuple is the cheapest object to make)."""

    slot: int
    token: int  # or ``FED``
    position: int


@dataclass
class StepPlan:
    feeds: list[Feed] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def outputs(self) -> int:
        """Rows of logits the step returns: one per feed, then one per last chunk (in order)."""
        return len(self.feeds) + sum(chunk.last for chunk in self.chunks)


class SlotModel(Protocol):
    """A model that runs steps on its own KV slots."""

    @property
    def slots(self) -> int: ...

    @property
    def vocab(self) -> int: ...

    def run(self, plan: StepPlan, fed: Tensor | None = None) -> Tensor:
        """Logits ``[plan.outputs, vocab]``, on the model's device. ``fed``: every feed's token, in
        order, on the device, in place of ``Feed.token`` (the tokens a step launched before chose,
        not read back yet)."""

    def release(self, slot: int) -> None:
        """The slot's sequence has left (its cache may be overwritten from now on)."""

    @property
    def keeps_prefixes(self) -> bool:
        """Whether a slot's keys and values stay as they are after ``release`` (``workers.engine.prefixes``)."""

    @property
    def one_call_rows(self) -> int:
        """The most rows (decoding rows, dummies among them, and prompt tokens) a step runs on its
        cheapest path, one more costing a jump (a step's layers in one call: ``workers.model.cpu.layerstep``);
        0 where no such limit."""

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copy positions ``0..length-1`` of slot ``source`` into slot ``target``."""
