"""The generation engine of one model: continuous batching in a step loop.

Sequences join the running batch between decoding steps (their prompts are prefilled together
and merged into the batch's KV cache) and leave it as soon as they finish or are stopped; every
sequence has its own token budget, sampling parameters and optional grammar constraint. Model
work runs on one dedicated thread; the asyncio loop dispatches each step's tokens to the
sequences' sinks, which turn them into events. See docs/performance.md for why this is our own
loop rather than transformers' ContinuousBatchingManager.
"""

import asyncio
import logging
from collections import deque
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from workers.batch import Batch, prefill
from workers.loader import LoadedModel
from workers.sampling import RowSampler, choose

logger = logging.getLogger(__name__)

# finish reasons decided by the engine; sinks and callers may stop a sequence with their own
STOP = "stop"  # a stop token (EOS) or a completed grammar
LENGTH = "length"  # the token budget or the context window is used up
ERROR = "error"  # the model step raised

PREFILL_TOKENS_PER_STEP = 8192


class Sink(Protocol):
    def on_token(self, seq: "Sequence", token: int) -> None: ...

    def on_finish(self, seq: "Sequence", reason: str, error: BaseException | None) -> None: ...


class Sequence:
    """One generation: a prompt, a budget, sampling, and where its tokens go."""

    def __init__(self, prompt_ids: Seq[int], max_new_tokens: int, sampler: RowSampler,
                 stop_token_ids: Seq[int], sink: Sink, generated: Seq[int] = ()) -> None:
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.sampler = sampler
        self.stop_token_ids = frozenset(stop_token_ids)
        self.sink = sink
        # tokens generated before a resume are part of the context and count against the budget
        self.generated: list[int] = list(generated)
        self.finish_reason: str | None = None
        self.stop_requested: str | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.generated

    def request_stop(self, reason: str) -> None:
        if self.stop_requested is None:
            self.stop_requested = reason


class Engine:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.capacity = loaded.spec.max_batch_size
        self.context_window = loaded.spec.context_window
        self._pending: deque[Sequence] = deque()
        self._rows: list[Sequence] = []  # aligned with the batch's rows
        self._batch: Batch | None = None
        self._work = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{loaded.spec.id}")

    @property
    def active(self) -> int:
        return len(self._rows) + len(self._pending)

    def submit(self, seq: Sequence) -> None:
        self._pending.append(seq)
        self._work.set()

    def stop(self, seq: Sequence, reason: str) -> None:
        seq.request_stop(reason)
        self._work.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._finish_stopped()
            joining = self._take_joining()
            if not self._live_rows() and not joining:
                self._rows, self._batch = [], None  # all finished: free the cache
                self._work.clear()
                await self._work.wait()
                continue
            try:
                produced = await loop.run_in_executor(self._executor, self._step, joining)
            except Exception as exc:
                logger.exception("model step failed; failing %d sequences", len(self._rows) + len(joining))
                self._fail_all(joining, exc)
                continue
            self._dispatch(produced)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- event-loop side ----------------------------------------------------------------------

    def _live_rows(self) -> list[Sequence]:
        return [seq for seq in self._rows if seq.finish_reason is None]

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            seq.sink.on_finish(seq, reason, error)

    def _finish_stopped(self) -> None:
        for seq in [*self._rows, *self._pending]:
            if seq.stop_requested is not None:
                self._finish(seq, seq.stop_requested)
        self._pending = deque(seq for seq in self._pending if seq.finish_reason is None)

    def _take_joining(self) -> list[Sequence]:
        joining: list[Sequence] = []
        room = self.capacity - len(self._live_rows())
        budget = PREFILL_TOKENS_PER_STEP
        while self._pending and len(joining) < room:
            cost = len(self._pending[0].context) * (len(joining) + 1)
            if joining and cost > budget:
                break
            joining.append(self._pending.popleft())
        return joining

    def _dispatch(self, produced: list[tuple[Sequence, int]]) -> None:
        for seq, token in produced:
            if seq.finish_reason is not None:
                continue
            seq.generated.append(token)
            try:
                seq.sink.on_token(seq, token)
            except Exception as exc:  # one sequence's failure must not end the loop that serves all
                logger.exception("a sequence's token handler failed; failing the sequence")
                self._finish(seq, ERROR, exc)
                continue
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if seq.stop_requested is not None:
            return seq.stop_requested
        constraint = seq.sampler.constraint
        if token in seq.stop_token_ids or (constraint is not None and constraint.done()):
            return STOP
        if len(seq.generated) >= seq.max_new_tokens or len(seq.prompt_ids) + len(seq.generated) >= self.context_window:
            return LENGTH
        return None

    def _fail_all(self, joining: list[Sequence], exc: BaseException) -> None:
        for seq in [*self._rows, *joining]:
            self._finish(seq, ERROR, exc)
        self._rows, self._batch = [], None

    # --- model thread -------------------------------------------------------------------------

    def _step(self, joining: list[Sequence]) -> list[tuple[Sequence, int]]:
        with torch.inference_mode():
            self._drop_finished_rows()
            produced = self._decode() if self._rows else []
            if joining:
                produced += self._admit(joining)
            return produced

    def _drop_finished_rows(self) -> None:
        keep = [i for i, seq in enumerate(self._rows) if seq.finish_reason is None]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._batch = None
        elif self._batch is not None:
            self._batch.select(keep)

    def _decode(self) -> list[tuple[Sequence, int]]:
        assert self._batch is not None
        batch = self._batch
        out = self.loaded.model(**batch.decode_inputs())
        tokens = choose(out.logits[:, -1, :], [seq.sampler for seq in self._rows])
        batch.positions = batch.positions + 1
        batch.last_tokens = torch.tensor(tokens, dtype=torch.long, device=batch.mask.device)
        return list(zip(self._rows, tokens, strict=True))

    def _admit(self, joining: list[Sequence]) -> list[tuple[Sequence, int]]:
        batch, logits = prefill(self.loaded.model, [seq.context for seq in joining], self.loaded.device)
        tokens = choose(logits, [seq.sampler for seq in joining])
        batch.last_tokens = torch.tensor(tokens, dtype=torch.long, device=batch.mask.device)
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.extend(batch)
        self._rows.extend(joining)
        return list(zip(joining, tokens, strict=True))
