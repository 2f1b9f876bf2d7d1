"""Prompt prefixes kept in KV slots.

A slot keeps the keys and values of the last sequence that ran in it after it leaves (nothing
clears them), and a running sequence's slot holds its prompt's. A new sequence whose context begins
with tokens a slot holds at the same positions (its conversation's previous turn, a system prompt
that every request repeats) starts from there instead of computing them again: from its own slot
as it is, or from another slot by copying that prefix into its own. At least the context's last
token is always computed, since its logits give the first new token.

New sequences take the lowest free slot (a step runs rows up to the highest one in use), so what
that slot holds is moved aside first, into the free slot holding the least recently used prefix:
the free slots keep the most recently used prefixes, not only the last one. Not where the new
sequence starts from that slot's own prefix and would overwrite fewer than ``MIN_COPIED`` of its
tokens: the copy would cost more than computing those again, and it stalls every running stream
(docs/performance.md, "Prompt prefixes kept in the slots").

Prefixes are shared only within one scope (the task's owner, and its prompt cache key where it has
one): a first token that comes fast would otherwise tell anyone what another principal's prompt
began with.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

MIN_COPIED = 16  # tokens a prefix must have to be copied from slot to slot rather than computed again


@dataclass(frozen=True)
class Reuse:
    """Where a new sequence's context starts: ``length`` positions held by slot ``source``."""

    source: int
    length: int


@dataclass(frozen=True)
class _Held:
    scope: str
    tokens: np.ndarray
    used: int  # when it was last kept or reused (a counter)


class Prefixes:
    """What each slot holds: whose tokens, and which ones at positions ``0, 1, ...``."""

    def __init__(self, slots: int) -> None:
        self._held: list[_Held | None] = [None] * slots
        self._clock = 0

    def keep(self, slot: int, scope: str, tokens: list[int] | np.ndarray) -> None:
        """Slot ``slot`` holds the keys and values of ``tokens`` (of ``scope``) at their positions."""
        self._clock += 1
        self._held[slot] = _Held(scope, np.asarray(tokens, dtype=np.int64), self._clock)

    def forget(self, slot: int) -> None:
        """The slot's positions will be overwritten."""
        self._held[slot] = None

    def length(self, slot: int) -> int:
        held = self._held[slot]
        return 0 if held is None else len(held.tokens)

    def best(self, slot: int, scope: str, context: list[int]) -> Reuse | None:
        """The longest prefix of ``context`` (short of its last token) that ``slot`` holds itself or
        another slot of ``scope`` holds with at least ``MIN_COPIED`` tokens; None: none."""
        wanted = np.asarray(context[:-1], dtype=np.int64)
        best: Reuse | None = None
        for source, held in enumerate(self._held):
            if held is None or held.scope != scope:
                continue
            length = _common(wanted, held.tokens)
            if source != slot and length < MIN_COPIED:
                continue
            if best is None or length > best.length or (length == best.length and source == slot):
                best = Reuse(source, length)
        if best is None or best.length == 0:
            return None
        self._touch(best.source)
        return best

    def spare(self, slot: int, free: Iterable[int], kept: int = 0) -> int | None:
        """Where to move what ``slot`` holds before it is overwritten from position ``kept`` on (the
        new sequence reuses the positions before): of the ``free`` slots, one that holds nothing,
        else the one whose prefix was used least recently if that is older than ``slot``'s; None:
        ``slot``'s prefix is not worth keeping, or too little of it would be lost to be worth copying
        the whole (a prompt sent again, a conversation's next turn: the copy of a long prompt delays
        every running stream; docs/performance.md, "Prompt prefixes kept in the slots")."""
        held = self._held[slot]
        if held is None or len(held.tokens) - kept < MIN_COPIED:
            return None
        candidates = [other for other in free if other != slot]
        empty = [other for other in candidates if self._held[other] is None]
        if empty:
            return max(empty)
        oldest = min(candidates, key=lambda other: self._used(other), default=None)
        return oldest if oldest is not None and self._used(oldest) < held.used else None

    def move(self, source: int, target: int) -> None:
        """What ``source`` holds is now (also) in ``target``."""
        self._held[target] = self._held[source]

    def _used(self, slot: int) -> int:
        held = self._held[slot]
        return -1 if held is None else held.used

    def _touch(self, slot: int) -> None:
        held = self._held[slot]
        if held is not None:
            self._clock += 1
            self._held[slot] = _Held(held.scope, held.tokens, self._clock)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
