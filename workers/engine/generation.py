"""One generation as the engine sees it: a prompt, a budget, sampling, and where its tokens go."""

from collections.abc import Sequence as Seq
from enum import StrEnum
from typing import Protocol

from workers.engine.sampling import RowSampler, Scores


class Finish(StrEnum):
    """Why a generation ended: the engine decides the first three, its task run asks for the others."""

    STOP = "stop"  # a stop token (EOS), a completed grammar, or a stop string in the text
    LENGTH = "length"  # the token budget or the context window is used up
    ERROR = "error"  # the model step raised
    CANCELLED = "cancelled"  # a client cancelled the task
    TIMEOUT = "timeout"  # the task ran past its time limit
    RELEASED = "released"  # handed back to the queue (worker shutdown): no final event
    FENCED = "fenced"  # another worker holds the task now: no final event


class Sink(Protocol):
    def on_token(self, seq: "Generation", token: int, scores: Scores | None) -> None:
        """A generated token, with its log-probabilities where the sampler asked for them."""

    def on_finish(self, seq: "Generation", reason: Finish, error: BaseException | None) -> None: ...


class Generation:
    """The engine's handle of a generation. ``generated`` holds the tokens delivered to the sink
    (and those generated before a resume, which are part of the context and count against the
    budget); ``stop_requested`` is set on the event loop and read by the model thread.
    ``prefix_scope``: who may share the prefixes of its context kept in KV slots (``workers.engine.prefixes``);
    ``cached_tokens``: how many tokens of its context it found there, set by the model thread when it
    joins."""

    def __init__(self, prompt_ids: Seq[int], max_new_tokens: int, sampler: RowSampler,
                 stop_token_ids: Seq[int], sink: Sink, generated: Seq[int] = (), prefix_scope: str = "") -> None:
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.sampler = sampler
        self.stop_token_ids = frozenset(stop_token_ids)
        self.sink = sink
        self.generated: list[int] = list(generated)
        self.finish_reason: Finish | None = None
        self.stop_requested: Finish | None = None
        self.prefix_scope = prefix_scope
        self.cached_tokens = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.generated

    def request_stop(self, reason: Finish) -> None:
        if self.stop_requested is None:
            self.stop_requested = reason
