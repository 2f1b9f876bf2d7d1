"""Choosing the next token of each row: greedy, or temperature / top-p sampling with an optional
per-sequence seed, after each sequence's logits constraint (a grammar) has masked its row."""

from dataclasses import dataclass, field
from typing import Protocol

import torch


class LogitsConstraint(Protocol):
    """Restricts what a sequence may generate next (grammar-constrained decoding)."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of forbidden tokens to -inf, in place (one row)."""

    def accept(self, token: int) -> None:
        """Advance past a generated token."""

    def done(self) -> bool:
        """Whether the constraint is complete and generation must stop."""


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

    def sample(self, logits: torch.Tensor) -> int:
        """One token from one row of logits (float32)."""
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            outside = sorted_probs.cumsum(-1) - sorted_probs > self.params.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator(logits.device)))


def choose(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """The next token of every row; advances each row's constraint."""
    logits = logits.float()
    for row, sampler in enumerate(samplers):
        if sampler.constraint is not None:
            sampler.constraint.mask(logits[row])
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    for row, sampler in enumerate(samplers):
        if not sampler.greedy:
            tokens[row] = sampler.sample(logits[row])
        if sampler.constraint is not None:
            sampler.constraint.accept(tokens[row])
    return tokens
