"""Constrained output that fits its token budget: how to complete a grammar from where a generation
stands (a *closing plan*), in tokens.

A worker keeps a plan for every grammar-constrained sequence and forces it once the tokens left
are no more than the plan's length, so tool calls and json_schema output always end complete and
valid (docs/protocol.md, "Output that fits its budget"); the API refuses at submit a budget that
is smaller than the plan from the start. Both find plans with this module, so they agree.

A plan is found greedily with the grammar's own matcher as the judge: the bytes the grammar forces
(property names, enum values, ``</tool_call>``), and where it leaves a choice, the first byte it
allows in ``PREFERENCE`` (what closes a string, an array or an object; the comma before a required
property; the smallest values), until the grammar may end there. A plan is usually, not always,
the shortest completion; it is always a valid one. Where the grammar may end already (free text,
after a call) the plan is empty: ending there is complete.
"""

from collections.abc import Iterable, Sequence

import llguidance
from tokenizers import Tokenizer

from lmsp_core.requests.catalog import ReasoningFormat

# where the grammar leaves a choice, bytes in this order: closers, the comma before a required
# property, the smallest values (0, "", [], {}), punctuation that ends runs in patterns (an e-mail
# address), digits, the letters of true/false/null, other letters, the rest
_FIRST = b'"}],0[{-@.:_/ 123456789tfn'
_LETTERS = bytes(range(ord("a"), ord("z") + 1)) + bytes(range(ord("A"), ord("Z") + 1))
PREFERENCE = _FIRST + bytes(b for b in _LETTERS if b not in _FIRST)
PREFERENCE += bytes(b for b in range(32, 127) if b not in PREFERENCE)
PREFERENCE += bytes(b for b in range(256) if b not in PREFERENCE)

MAX_PLAN = 256  # tokens: where completing the grammar takes more, there is no plan (and no guarantee)
MAX_REPEATS = 3  # the same chosen byte at most this many times in a row (a pattern's loop)


class GrammarTokenizer:
    """llguidance's view of a model's tokenizer, with what plans need: one token per byte."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.ll = tokenizer
        self.eos = tokenizer.eos_token
        self._bytes = [(byte, token) for byte in PREFERENCE if (token := self._byte_token(byte)) is not None]

    @classmethod
    def build(cls, tokenizer_json: str, stop_token_ids: Sequence[int]) -> "GrammarTokenizer":
        """From a model card's tokenizer (about half a second: keep one per model)."""
        return cls(llguidance.LLTokenizer(tokenizer_json, eos_token=list(stop_token_ids)))

    def _byte_token(self, byte: int) -> int | None:
        ids = self.ll.tokenize_bytes(bytes([byte]))
        return ids[0] if len(ids) == 1 and self.ll.decode_bytes(ids) == bytes([byte]) else None

    def plan(self, matcher: llguidance.LLMatcher, closers: Iterable[Sequence[int]] = ()) -> list[int] | None:
        """Tokens after which the grammar may end, from ``matcher``'s state (left as it was); None if
        none were found within ``MAX_PLAN`` tokens. ``closers`` are token sequences tried first, as
        wholes (the end of a reasoning section: its free text would otherwise never end)."""
        walk = _Walk(matcher)
        try:
            if matcher.is_stopped() or matcher.is_accepting():
                return []
            lead = next((list(closer) for closer in closers if walk.take(closer)), [])
            start = walk.taken
            tail = self._greedy(walk)
            if tail is None:
                return None
            walk.undo_to(start)
            return lead + self._compact(walk, tail)
        finally:
            walk.undo_to(0)

    def closes(self, matcher: llguidance.LLMatcher, plan: Sequence[int]) -> bool:
        """Whether ``plan`` completes the grammar from ``matcher``'s state (left as it was)."""
        consumed = matcher.try_consume_tokens(list(plan)) if plan else 0
        done = consumed == len(plan) and (matcher.is_stopped() or matcher.is_accepting())
        if consumed:
            matcher.rollback(consumed)
        return done

    def _greedy(self, walk: "_Walk") -> list[int] | None:
        matcher = walk.matcher
        tokens: list[int] = []
        last, run = -1, 0
        while len(tokens) < MAX_PLAN:
            if matcher.is_stopped() or matcher.is_accepting():
                return tokens
            forced = matcher.compute_ff_bytes()
            if forced:
                ids = self.ll.tokenize_bytes(forced)
                if not walk.take(ids):
                    return None
                tokens += ids
                continue
            for byte, token in self._bytes:
                if (run < MAX_REPEATS or byte != last) and walk.take([token]):
                    run, last = (run + 1 if byte == last else 1), byte
                    tokens.append(token)
                    break
            else:
                return None
        return None

    def _compact(self, walk: "_Walk", tail: list[int]) -> list[int]:
        """The plan's bytes in the tokenizer's own (usually fewer) tokens, where the grammar takes them."""
        merged = self.ll.tokenize_bytes(self.ll.decode_bytes(tail))
        if len(merged) < len(tail) and self.closes(walk.matcher, merged):
            return merged
        return tail


class _Walk:
    """Tokens consumed on a matcher for a search, to be rolled back."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.taken = 0

    def take(self, tokens: Sequence[int]) -> bool:
        """Consume all of ``tokens``, or none of them."""
        if not tokens:
            return True
        consumed = self.matcher.try_consume_tokens(list(tokens))
        if consumed < len(tokens):
            if consumed:
                self.matcher.rollback(consumed)
            return False
        self.taken += consumed
        return True

    def undo_to(self, taken: int) -> None:
        if self.taken > taken:
            self.matcher.rollback(self.taken - taken)
            self.taken = taken


def reasoning_closing_ids(tokenizer: Tokenizer, reasoning: ReasoningFormat) -> list[int]:
    """The tokens that close a reasoning section (what a worker forces when its budget runs out)."""
    ids: list[int] = tokenizer.encode(reasoning.closing_text, add_special_tokens=False).ids
    return ids


def closing_tokens(tokenizer: Tokenizer, reasoning: ReasoningFormat) -> list[int]:
    """The tokens that close a section (``closing_text``); checks that they decode as text (a
    marker that is a special token would be invisible to the parser)."""
    ids = reasoning_closing_ids(tokenizer, reasoning)
    if reasoning.end not in tokenizer.decode(ids, skip_special_tokens=True):
        raise ValueError(f"the reasoning end marker {reasoning.end!r} does not decode as text with this tokenizer")
    return ids


def output_tokens_needed(tokenizer: GrammarTokenizer, grammar: str,
                         closers: Iterable[Sequence[int]] = ()) -> int | None:
    """Tokens of the shortest output the planner finds for ``grammar``: what a response needs at least
    (None: the grammar has no plan, and no minimum is enforced)."""
    matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
    if matcher.is_error():
        return None
    plan = tokenizer.plan(matcher, closers)
    return None if plan is None else len(plan)
