"""A response's output path: tokens -> text -> reasoning section and answer -> stop strings -> items.

One way: tokens go in, the events they cause come out (``push`` returns them). Every stage depends
only on what it was fed, so replaying a resumed task's stored tokens (dropping the events they
cause, which are stored already) brings the whole path to the state whose events are stored.

A token's log-probability entry, where the request asked for them, waits until the token's text
comes out of the answer's text delta, which then carries it; a token whose text goes elsewhere (the
reasoning section, a function call) leaves none.
"""

from collections.abc import Iterable, Sequence

import msgspec
from tokenizers import Tokenizer

from lmsp_core import wire
from lmsp_core.requests.catalog import ReasoningFormat
from workers.output.items import OutEvent, OutputAssembler
from workers.output.reasoning import ReasoningParser, Segment
from workers.output.stops import StopFilter
from workers.output.textstream import TextStream


class OutputPipeline:
    def __init__(self, tokenizer: Tokenizer, assembler: OutputAssembler, reasoning: ReasoningFormat | None = None,
                 stops: Sequence[str] = ()) -> None:
        self.assembler = assembler
        self._text = TextStream(tokenizer)
        self._parser = ReasoningParser(reasoning)
        self._stops = StopFilter(stops)
        self._answering = False
        self._tokens = 0
        self._closed_at: int | None = None  # tokens generated when the reasoning section closed
        self._logprobs: list[wire.TokenLogprob] = []  # of tokens whose text has not come out yet
        self._closing = False  # the token being pushed closed the reasoning section
        self._plain = reasoning is None and not stops  # every token's text goes to the answer as it is

    @property
    def stopped(self) -> bool:
        """A stop string appeared: the answer is complete and generation should end."""
        return self._stops.hit

    @property
    def reasoning_tokens(self) -> int:
        """Tokens from the start of the output to the end of the reasoning section (0 without one)."""
        if not self._parser.opened:
            return 0
        return self._tokens if self._closed_at is None else self._closed_at

    def start(self) -> list[OutEvent]:
        """Announce what is known before the first token: an open section, or the message."""
        if self._parser.state == "reasoning":
            self.assembler.open_reasoning()
        elif self._parser.state == "answer":
            self._start_answer()
        return self.assembler.take()

    def push(self, token: int, logprob: wire.TokenLogprob | None = None) -> list[OutEvent]:
        """One generated token in (with its log-probability entry, where asked); the events it causes out."""
        self._tokens += 1
        if self._plain:  # no section to find, no stop string to hold back: the text is the answer's
            self.assembler.feed(self._text.push(token))
        else:
            self._apply(self._parser.feed(self._text.push(token)))
        closing, self._closing = self._closing, False
        if logprob is None:
            return self.assembler.take()
        if closing:  # the section's tokens, its end marker's included, have no entries
            self._logprobs = []
            return self.assembler.take()
        self._logprobs.append(logprob)
        return self._with_logprobs(self.assembler.take())

    def replay(self, tokens: Iterable[int]) -> None:
        """Start, and feed tokens whose events are stored already (dropped here)."""
        self.start()
        for token in tokens:
            self.push(token)

    def finish(self) -> tuple[list[wire.OutputItem], list[OutEvent]]:
        """Release held text (unless a stop string ended the answer) and close the items: the items
        and the events that closing them causes."""
        if not self.stopped:
            self._apply(self._parser.finish())
            if self._answering:
                self.assembler.feed(self._stops.flush())
        if not self._answering:  # ended inside the section: a text response still has its message
            self.assembler.close_reasoning()
            self._start_answer()
        events = self._with_logprobs(self.assembler.take()) if self._logprobs else []
        items = self.assembler.finish()
        return items, events + self.assembler.take()

    def _with_logprobs(self, events: list[OutEvent]) -> list[OutEvent]:
        """The waiting log-probabilities go with the last text delta among ``events``; where the
        text went to no message (reasoning, a call) they are dropped."""
        for index in range(len(events) - 1, -1, -1):
            name, data = events[index]
            if name == wire.TEXT_DELTA:
                events[index] = (name, msgspec.structs.replace(data, logprobs=self._logprobs))
                self.assembler.add_logprobs(self._logprobs)
                self._logprobs = []
                return events
        if not self._answering or self.assembler.mode == "calls":
            self._logprobs = []
        return events

    def _apply(self, segments: list[Segment]) -> None:
        for segment in segments:
            if self.stopped:
                return
            if segment.kind == "open":
                self.assembler.open_reasoning()
            elif segment.kind == "reasoning":
                self.assembler.add_reasoning(segment.text)
            elif segment.kind == "close":
                self._closed_at = self._tokens
                self._closing = True
                self.assembler.close_reasoning()
                self._start_answer()
            else:
                self._start_answer()
                self.assembler.feed(self._stops.feed(segment.text))

    def _start_answer(self) -> None:
        if not self._answering:
            self._answering = True
            self.assembler.start()
