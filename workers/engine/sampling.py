"""Choosing the next token of each row: greedy, or temperature / top-p sampling with an optional
per-sequence seed, after each sequence's constraint (a grammar, a reasoning budget) has said which
tokens it allows.

Everything runs on the model's device: constraints write their allowed tokens as bits into a host
buffer, which goes to the device in one copy and masks all constrained rows at once; the chosen
tokens come back to the host in one copy per step. ``TokenChooser.launch`` leaves them on the device
until ``Chosen.read``: a GPU step that feeds them to the next one starts it before they are read
(``workers.engine.scheduler``, "launching ahead").
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

BITS = 32  # tokens per word of a bitmask row (llguidance's layout: bit i of word j is token 32j+i)


class LogitsConstraint(Protocol):
    """Restricts what a sequence may generate next (grammar-constrained decoding)."""

    def allow(self, bitmask: Tensor) -> None:
        """Write the tokens allowed next into ``bitmask`` (one row of int32 words, on the host)."""

    def accept(self, token: int) -> int:
        """Advance past a generated token; returns the token the sequence takes: ``token``, or one the
        constraint puts in its place (a grammar that must complete within the budget)."""

    def done(self) -> bool:
        """Whether the constraint is complete and generation must stop."""


def allow_only(bitmask: Tensor, token: int) -> None:
    """A bitmask row that allows one token."""
    bitmask.zero_()
    word, bit = divmod(token, BITS)
    bitmask[word] = -(1 << 31) if bit == 31 else 1 << bit


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class RowSampler:
    """The sampling state of one sequence: its parameters and its random generator."""

    params: SamplingParams
    constraint: LogitsConstraint | None = None
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0.0

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            if self.params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.params.seed)
        return self._generator

    def sample(self, logits: Tensor) -> Tensor:
        """One token (a 1-element tensor on the logits' device) from one row of logits (float32)."""
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            outside = sorted_probs.cumsum(-1) - sorted_probs > self.params.top_p
            sorted_probs.masked_fill_(outside, 0.0)  # not ``[outside] = 0``: that indexes, a host sync on a GPU
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator(logits.device))


class Chosen:
    """A step's chosen tokens: ``tokens`` on the device at once, on the host once ``read``."""

    def __init__(self, tokens: Tensor, host: Tensor | None, accept: Callable[[list[int]], list[int]]) -> None:
        self.tokens = tokens  # [rows] int64 on the device: what a following step may be fed
        self._host = host  # pinned, being filled by a copy behind the step (a GPU), or None
        self._copied = torch.cuda.Event() if host is not None else None  # type: ignore[no-untyped-call]
        if self._copied is not None:
            self._copied.record()
        self._accept = accept

    def read(self) -> list[int]:
        """The tokens on the host (waiting for their copy, not for steps launched since), after each
        row's constraint has taken its token."""
        if self._copied is not None and self._host is not None:
            self._copied.synchronize()
            return self._accept(self._host.tolist())
        return self._accept(self.tokens.tolist())


class TokenChooser:
    """Chooses the next token of up to ``rows`` rows per call, on ``device``."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        words = (vocab + BITS - 1) // BITS
        self._host_masks = torch.zeros((rows, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._bits = torch.arange(BITS, dtype=torch.int32, device=device)
        # where a GPU's tokens are copied to: two, as a step may be launched before the last one is read
        self._host_tokens = [torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if device.type == "cuda" else []
        self._launched = 0

    def launch(self, logits: Tensor, samplers: list[RowSampler]) -> Chosen:
        """Choose the next token of every row of ``logits`` on the device, and start their one copy to
        the host; each row's constraint takes its token when the result is read."""
        logits = logits.float()
        constrained = [row for row, sampler in enumerate(samplers) if sampler.constraint is not None]
        if constrained:
            self._mask(logits, constrained, samplers)
        tokens = logits.argmax(dim=-1)
        for row, sampler in enumerate(samplers):
            if not sampler.greedy:
                tokens[row:row + 1] = sampler.sample(logits[row])

        def accepted(chosen: list[int]) -> list[int]:
            for row in constrained:
                constraint = samplers[row].constraint
                assert constraint is not None
                chosen[row] = constraint.accept(chosen[row])
            return chosen

        if not self._host_tokens:
            return Chosen(tokens, None, accepted)
        host = self._host_tokens[self._launched % 2][:tokens.shape[0]]
        self._launched += 1
        host.copy_(tokens, non_blocking=True)
        return Chosen(tokens, host, accepted)

    def _mask(self, logits: Tensor, rows: list[int], samplers: list[RowSampler]) -> None:
        masks = self._host_masks[: len(rows)]
        for i, row in enumerate(rows):
            constraint = samplers[row].constraint
            assert constraint is not None
            constraint.allow(masks[i])
        words = masks.to(self.device, non_blocking=True)
        allowed = ((words[:, :, None] >> self._bits) & 1).flatten(1).bool()
        width = logits.shape[-1]
        if allowed.shape[1] < width:  # the model's rows beyond the tokenizer's vocabulary
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
        index = torch.tensor(rows, device=self.device)
        logits[index] = logits[index].masked_fill(~allowed[:, :width], float("-inf"))
