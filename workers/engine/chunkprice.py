"""What prompt chunks cost beside decoding, and how many prompt tokens a step takes
(``workers.engine.scheduler``): a price fitted as the steps run (``ChunkCost``), and the budget it allows
(``chunk_budget``).
"""

import math
from dataclasses import dataclass

import numpy as np

MAX_CHUNK = 512  # prompt tokens of one sequence per step (bounds a step's attention memory)
# prompt tokens of a chunk beside decoding, at least (on a slow CPU even 16 cost more than ``STALL``
# decoding steps: docs/performance.md, "Continuous batching and chunked prompts")
MIN_CHUNK = 4
# prompt tokens per step while others decode: as many as cost this many decoding steps (the steps
# run somewhat over it; less delays the others less and the prompt's join more:
# docs/performance.md, "Continuous batching and chunked prompts")
STALL = 0.45
SMOOTHING = 0.2  # weight of the newest measurement in the chunks' running cost estimates


@dataclass(frozen=True)
class Price:
    """What prompt chunks add to a step: ``fixed + per_token * tokens + per_position * pairs`` seconds,
    ``pairs`` being the query-key pairs of their attention (each chunk's tokens times the position
    after its last one): the attention of a chunk deep in a long prompt costs more per token than
    one near its start."""

    fixed: float
    per_token: float
    per_position: float = 0.0


def chunk_budget(decode_seconds: float, price: Price, start: int = 0, waiting: float = 1.0) -> int:
    """Prompt tokens for a step while others decode, for a chunk from position ``start``: as many as
    cost ``STALL`` decoding steps, ``waiting`` times that where more sequences wait for their prompts
    than decode (the step's stall is paid by the decoding ones, the wait by the joining ones: a
    burst of prompts beside one stream joins in a few steps, not dozens); where chunks cost a fixed
    price beyond that anyway, as many as cost that price again (fewer, larger stalls rather than
    many small ones)."""
    spend = max(STALL * waiting * decode_seconds - price.fixed, price.fixed)
    # the most tokens n with n * (per_token + per_position * (start + n)) <= spend
    linear = price.per_token + price.per_position * start
    if price.per_position > 0:
        tokens = (math.sqrt(linear * linear + 4 * price.per_position * spend) - linear) / (2 * price.per_position)
    else:
        tokens = spend / linear
    return max(MIN_CHUNK, min(MAX_CHUNK, int(tokens + 1e-9)))  # 1e-9: a budget met exactly, in floats


class ChunkCost:
    """What prompt chunks add to a step (``Price``), fitted by least squares over the recent steps,
    older steps weighing less. ``fixed`` matters where a step with chunks runs slower machinery than
    a decoding-only one (an eager pass beside a CUDA graph, a dense product beside 4-bit ones); each
    term is fitted only where the steps tell it apart (chunk sizes that vary for ``fixed``, positions
    that vary for ``per_position``), and a fit that noise made negative falls back to fewer terms."""

    _TERMS = ((0, 1, 2), (0, 1), (1, 2), (1,))  # of (fixed, per_token, per_position), most first

    def __init__(self) -> None:
        self._sums = np.zeros((4, 4))  # weighted sums of the products of (1, tokens, pairs, seconds)

    def add(self, tokens: int, pairs: int, seconds: float) -> None:
        row = np.array([1.0, tokens, pairs, seconds])
        self._sums = (1 - SMOOTHING) * self._sums + np.outer(row, row)

    def fit(self) -> Price | None:
        """The price, or None before the first measurement."""
        weight = self._sums[0, 0]
        if not weight:
            return None
        mean = self._sums[0] / weight
        sizes_vary = self._sums[1, 1] / weight - mean[1] ** 2 > (0.1 * mean[1]) ** 2
        for terms in self._TERMS:
            if 0 in terms and not sizes_vary:
                continue  # chunks of about one size: no intercept to see
            coefficients = self._solve(terms)
            if coefficients is not None and min(coefficients) >= 0 and coefficients[terms.index(1)] > 0:
                price = dict(zip(terms, coefficients, strict=True))
                return Price(price.get(0, 0.0), price[1], price.get(2, 0.0))
        return Price(0.0, max(mean[3] / mean[1], 1e-9))  # noise hiding every slope: the mean price

    def _solve(self, terms: tuple[int, ...]) -> list[float] | None:
        index = list(terms)
        normal = self._sums[np.ix_(index, index)]
        scale = np.sqrt(np.diag(normal))
        if not scale.all():
            return None
        scaled = normal / np.outer(scale, scale)  # the terms' units differ by orders of magnitude
        if np.linalg.cond(scaled) > 1e8:
            return None  # terms the steps do not tell apart (a position term while positions stay put)
        solved = np.linalg.solve(scaled, self._sums[index, 3] / scale) / scale
        return [float(value) for value in solved]
