"""The reasoning section of a reasoning model's output, in text and in tokens.

``ReasoningParser`` splits decoded text into the section (``start`` ... ``end``) and the answer
after it. ``ReasoningConstraint`` enforces the reasoning budget: once the section has used its
tokens, it forces the closing marker token by token, then lets the output grammar (if any) decide.
Both depend on nothing but the text and the tokens, so a resumed task that replays its stored
tokens reaches the same state (docs/protocol.md, "Reasoning").
"""

from collections import deque
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from tokenizers import Tokenizer

from lmsp_core.requests.catalog import ReasoningFormat
from workers.engine.sampling import allow_only
from workers.output.grammar import GrammarConstraint
from workers.output.textstream import TextStream

WHITESPACE = " \t\r\n"  # what may surround the markers (the grammars' whitespace)

State = Literal["undecided", "reasoning", "answer"]


class Segment(NamedTuple):
    kind: Literal["open", "reasoning", "close", "answer"]
    text: str = ""


class ReasoningParser:
    """Decoded text -> segments: ``open``, ``reasoning`` text, ``close``, ``answer`` text.

    Reasoning text never contains the markers nor the whitespace around them: text that may be the
    start of the end marker, and trailing whitespace, is held back until the next text decides.
    The answer after a section starts at its first non-whitespace character. Without a reasoning
    format every text is answer text, unchanged."""

    def __init__(self, reasoning: ReasoningFormat | None) -> None:
        self.format = reasoning
        self.state: State = "answer"
        if reasoning is not None:
            self.state = "undecided" if reasoning.opened_by == "model" else "reasoning"
        self.opened = self.state == "reasoning"  # a section opened (at some point)
        self.closed = False
        self._held = ""
        self._lead = self.opened  # strip whitespace at the start of the section / of the answer after it

    def feed(self, text: str) -> list[Segment]:
        if not text:
            return []
        if self.state == "answer":
            return self._answer(text)
        if self.state == "undecided":
            return self._undecided(text)
        return self._reasoning(text)

    def finish(self) -> list[Segment]:
        """The text still held when generation ends (a partial marker is just text then)."""
        held, self._held = self._held, ""
        if self.state == "undecided":
            self.state = "answer"
            return [Segment("answer", held)] if held else []
        if self.state == "reasoning":
            text = held.rstrip(WHITESPACE)
            return [Segment("reasoning", text)] if text else []
        return []

    def _undecided(self, text: str) -> list[Segment]:
        assert self.format is not None
        self._held += text
        rest = self._held.lstrip(WHITESPACE)
        if rest.startswith(self.format.start):
            self._held, self.state, self.opened, self._lead = "", "reasoning", True, True
            return [Segment("open"), *self._reasoning(rest[len(self.format.start):])]
        if self.format.start.startswith(rest):
            return []  # may still become the start marker
        held, self._held, self.state, self._lead = self._held, "", "answer", False
        return [Segment("answer", held)]

    def _reasoning(self, text: str) -> list[Segment]:
        assert self.format is not None
        buffer = self._held + text
        if self._lead:
            buffer = buffer.lstrip(WHITESPACE)
            self._lead = not buffer
        end = buffer.find(self.format.end)
        if end >= 0:
            self._held, self.state, self.closed, self._lead = "", "answer", True, True
            body = buffer[:end].rstrip(WHITESPACE)
            return [*([Segment("reasoning", body)] if body else []), Segment("close"),
                    *self._answer(buffer[end + len(self.format.end):])]
        cut = len(buffer) - partial_suffix(buffer, (self.format.end,))
        cut = len(buffer[:cut].rstrip(WHITESPACE))
        self._held = buffer[cut:]
        return [Segment("reasoning", buffer[:cut])] if cut else []

    def _answer(self, text: str) -> list[Segment]:
        if self._lead:
            text = text.lstrip(WHITESPACE)
            self._lead = not text
        return [Segment("answer", text)] if text else []


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ReasoningConstraint:
    """A ``LogitsConstraint`` for reasoning models: the budget, then the output grammar.

    It decodes the tokens itself (on the engine's thread) to know whether the section is open.
    After ``budget`` generated tokens with the section open, the next tokens are forced to the
    closing marker; the grammar (which covers the section too) sees every token. A grammar that
    must complete within the token budget comes first: its plan closes the section with the same
    tokens (``closing`` is one of its closers), then completes the answer."""

    def __init__(self, tokenizer: Tokenizer, reasoning: ReasoningFormat, budget: int | None, closing: Sequence[int],
                 grammar: GrammarConstraint | None = None, generated: Sequence[int] = ()) -> None:
        self._text = TextStream(tokenizer)
        self._parser = ReasoningParser(reasoning)
        self._budget = budget
        self._closing = list(closing)
        self._forced: deque[int] = deque()
        self._forcing_done = False
        self._grammar = grammar  # already advanced past ``generated``
        self._count = 0
        self._check_budget()
        for token in generated:
            self._advance(token)
            self._check_budget()

    def allow(self, bitmask: torch.Tensor) -> None:
        if self._forced and not (self._grammar is not None and self._grammar.closing):
            allow_only(bitmask, self._forced[0])
        elif self._grammar is not None:
            self._grammar.allow(bitmask)
        else:
            bitmask.fill_(-1)

    def accept(self, token: int) -> int:
        if self._grammar is not None:
            token = self._grammar.accept(token)
        self._advance(token)
        self._check_budget()
        return token

    def done(self) -> bool:
        return self._grammar is not None and self._grammar.done()

    def _advance(self, token: int) -> None:
        if self._forced and self._forced[0] == token:
            self._forced.popleft()
        else:  # the grammar's plan took another way (it closes the section itself)
            self._forced.clear()
        self._count += 1
        self._parser.feed(self._text.push(token))

    def _check_budget(self) -> None:
        if (self._budget is not None and not self._forcing_done and self._parser.state == "reasoning"
                and self._count >= self._budget):
            self._forced.extend(self._closing)
            self._forcing_done = True
