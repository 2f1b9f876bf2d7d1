"""One generation as the engine sees it: a prompt, a budget, sampling, and where its tokens go."""

from collections.abc import Sequence as Seq
from typing import Protocol

from workers.sampling import RowSampler

# finish reasons decided by the engine; sinks and callers may stop a sequence with their own
STOP = "stop"  # a stop token (EOS) or a completed grammar
LENGTH = "length"  # the token budget or the context window is used up
ERROR = "error"  # the model step raised


class Sink(Protocol):
    def on_token(self, seq: "Sequence", token: int) -> None: ...

    def on_finish(self, seq: "Sequence", reason: str, error: BaseException | None) -> None: ...


class Sequence:
    """The engine's handle of a generation. ``generated`` holds the tokens delivered to the sink
    (and those generated before a resume, which are part of the context and count against the
    budget); ``stop_requested`` is set on the event loop and read by the model thread."""

    def __init__(self, prompt_ids: Seq[int], max_new_tokens: int, sampler: RowSampler,
                 stop_token_ids: Seq[int], sink: Sink, generated: Seq[int] = ()) -> None:
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.sampler = sampler
        self.stop_token_ids = frozenset(stop_token_ids)
        self.sink = sink
        self.generated: list[int] = list(generated)
        self.finish_reason: str | None = None
        self.stop_requested: str | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.generated

    def request_stop(self, reason: str) -> None:
        if self.stop_requested is None:
            self.stop_requested = reason
