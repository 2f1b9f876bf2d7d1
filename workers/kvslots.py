"""KV slots: the cache of a worker's model, and what one model step is asked to do with it.

Every running sequence owns a slot: room for the keys and values of a whole context window.
The cache is allocated once per worker and model; joining and leaving never copy, concatenate or
allocate it (a new sequence may start from a prefix another slot holds, ``workers.prefixes``: that
is copied once, in place of computing it). A step (``StepPlan``) feeds one token to each decoding
sequence and chunks of prompts to sequences that are joining; a ``SlotModel`` runs it and returns
the logits asked for.
"""

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from numpy._core import multiarray
from torch import Tensor, nn


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


@dataclass(frozen=True)
class Feed:
    """One decoding sequence's next token, at ``position`` of its slot."""

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
        """Whether a slot's keys and values stay as they are after ``release`` (``workers.prefixes``)."""

    @property
    def one_call_rows(self) -> int:
        """The most rows (decoding rows, dummies among them, and prompt tokens) a step runs on its
        cheapest path, one more costing a jump (a step's layers in one call: ``workers.layerstep``);
        0 where no such limit."""

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copy positions ``0..length-1`` of slot ``source`` into slot ``target``."""


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros whose memory, on a CPU, is committed only where written (calloc'ed pages): a slot
    array sized for the whole context window costs what the sequences use."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # numpy asks for huge pages on large arrays, which would commit 2 MiB at the first write
    huge = multiarray._set_madvise_hugepage(False)  # type: ignore[attr-defined]
    try:
        raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    finally:
        multiarray._set_madvise_hugepage(huge)  # type: ignore[attr-defined]
    return torch.from_numpy(raw).view(dtype)


class KvSlots(nn.Module):
    """Keys and values of every layer, ``[slots, kv_heads, positions, head_dim]`` each."""

    def __init__(self, layers: int, slots: int, kv_heads: int, positions: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (slots, kv_heads, positions, head_dim)
        self.slots, self.positions = slots, positions
        for i in range(layers):
            self.register_buffer(f"k{i}", lazy_zeros(shape, dtype, device), persistent=False)
            self.register_buffer(f"v{i}", lazy_zeros(shape, dtype, device), persistent=False)
        # one position of one slot, keys and values of every layer
        self.position_bytes = 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        for buffer in self.buffers():
            buffer[target, :, :length] = buffer[source, :, :length]
