"""Choosing the next token of each row: greedy, or temperature / top-p sampling with an optional
per-sequence seed, after each sequence's constraint (a grammar, a reasoning budget) has said which
tokens it allows.

Everything runs on the model's device: constraints write their allowed tokens as bits into a host
buffer, which goes to the device in one copy and masks all constrained rows at once; the chosen
tokens come back to the host in one copy per step. ``TokenChooser.launch`` leaves them on the device
until ``Chosen.read``: a GPU step that feeds them to the next one starts it before they are read
(``workers.engine.scheduler``, "launching ahead"). Rows that ask for log-probabilities get them
from the model's own distribution (the log-softmax of its logits, before temperature, top-p and
masks: docs/protocol.md, "Log probabilities"), computed on the device and copied with one more copy
a step; rows that do not ask cost nothing.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

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
    # how many of the most likely tokens each step reports beside the chosen one, with their
    # log-probabilities; None: no log-probabilities at all
    logprobs: int | None = None


class Scores(NamedTuple):
    """A chosen token's log-probability and the most likely tokens' (ids, most likely first)."""

    logprob: float
    top: list[tuple[int, float]]


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


class Scored(NamedTuple):
    """Log-probabilities of the rows that asked for them, packed for one copy: per scored row, the
    chosen token's, then the ``top`` highest, then their ids (as float64: exact for any vocabulary)."""

    rows: list[int]
    counts: list[int]  # how many of the highest each row asked for
    log: Tensor  # [scored rows, vocabulary] log-softmax, on the device: a replaced token's is read here
    packed: Tensor  # [scored rows, 1 + 2 * max(counts)], on the host once copied

    def scores(self, rows: int, drawn: list[int], taken: list[int]) -> list[Scores | None]:
        """Each row's scores (None where not asked); a token a constraint put in place of the drawn
        one has its own log-probability."""
        out: list[Scores | None] = [None] * rows
        table = self.packed.tolist()
        width = max(self.counts)
        for i, (row, count) in enumerate(zip(self.rows, self.counts, strict=True)):
            values = table[i]
            logprob = values[0] if taken[row] == drawn[row] else float(self.log[i, taken[row]])
            out[row] = Scores(logprob, [(int(values[1 + width + j]), values[1 + j]) for j in range(count)])
        return out


class Chosen:
    """A step's chosen tokens: ``tokens`` on the device at once, on the host once ``read``; then
    ``scores``, each row's log-probabilities where it asked for them."""

    def __init__(self, tokens: Tensor, host: Tensor | None, accept: Callable[[list[int]], list[int]],
                 scored: Scored | None = None) -> None:
        self.tokens = tokens  # [rows] int64 on the device: what a following step may be fed
        self._host = host  # pinned, being filled by a copy behind the step (a GPU), or None
        self._copied = torch.cuda.Event() if host is not None else None  # type: ignore[no-untyped-call]
        if self._copied is not None:
            self._copied.record()
        self._accept = accept
        self._scored = scored
        self.scores: list[Scores | None] = []

    def read(self) -> list[int]:
        """The tokens on the host (waiting for their copy, not for steps launched since), after each
        row's constraint has taken its token."""
        if self._copied is not None and self._host is not None:
            self._copied.synchronize()
            drawn = self._host.tolist()
        else:
            drawn = self.tokens.tolist()
        taken = self._accept(list(drawn))
        self.scores = self._scored.scores(len(taken), drawn, taken) if self._scored is not None \
            else [None] * len(taken)
        return taken


class TokenChooser:
    """Chooses the next token of up to ``rows`` rows per call, on ``device``."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        words = (vocab + BITS - 1) // BITS
        self._host_masks = torch.zeros((rows, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._bits = torch.arange(BITS, dtype=torch.int32, device=device)
        # where a GPU's tokens (and log-probabilities) are copied to: two, as a step may be launched
        # before the last one is read
        cuda = device.type == "cuda"
        self._host_tokens = [torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)] if cuda else []
        self._host_scores = [torch.empty(0, dtype=torch.float64, pin_memory=True) for _ in range(2)] if cuda else []
        self._launched = 0

    def launch(self, logits: Tensor, samplers: list[RowSampler]) -> Chosen:
        """Choose the next token of every row of ``logits`` on the device, and start their one copy to
        the host; each row's constraint takes its token when the result is read."""
        logits = logits.float()
        scoring = [row for row, sampler in enumerate(samplers) if sampler.params.logprobs is not None]
        log = torch.log_softmax(logits[scoring], dim=-1) if scoring else None  # a copy: before any mask
        constrained = [row for row, sampler in enumerate(samplers) if sampler.constraint is not None]
        if constrained:
            self._mask(logits, constrained, samplers)
        tokens = logits.argmax(dim=-1)
        for row, sampler in enumerate(samplers):
            if not sampler.greedy:
                tokens[row:row + 1] = sampler.sample(logits[row])
        scored = self._score(log, tokens, scoring, samplers) if log is not None else None

        def accepted(chosen: list[int]) -> list[int]:
            for row in constrained:
                constraint = samplers[row].constraint
                assert constraint is not None
                chosen[row] = constraint.accept(chosen[row])
            return chosen

        if not self._host_tokens:
            return Chosen(tokens, None, accepted, scored)
        host = self._host_tokens[self._launched % 2][:tokens.shape[0]]
        if scored is not None:
            scored = scored._replace(packed=self._copy_scores(scored.packed))
        self._launched += 1
        host.copy_(tokens, non_blocking=True)
        return Chosen(tokens, host, accepted, scored)

    def _copy_scores(self, packed: Tensor) -> Tensor:
        """Start the copy of a step's packed log-probabilities into its pinned host buffer (grown to
        the largest a step has needed: rows asking for more alternatives make it wider)."""
        which = self._launched % 2
        if self._host_scores[which].numel() < packed.numel():
            self._host_scores[which] = torch.empty(packed.numel(), dtype=torch.float64, pin_memory=True)
        host = self._host_scores[which][:packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        return host

    @staticmethod
    def _score(log: Tensor, tokens: Tensor, rows: list[int], samplers: list[RowSampler]) -> Scored:
        """The scored rows' chosen log-probabilities and highest ones, packed into one tensor."""
        counts = [samplers[row].params.logprobs or 0 for row in rows]
        chosen = log.gather(1, tokens[rows].unsqueeze(1))
        values, ids = log.topk(max(counts), dim=-1)
        packed = torch.cat([chosen.double(), values.double(), ids.double()], dim=1)
        return Scored(rows, counts, log, packed)

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
