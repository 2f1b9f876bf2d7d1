"""The generation engine of one model: continuous batching on KV slots.

Sequences join the running batch between steps (their prompts prefilled in chunks into their own
KV slot) and leave it as soon as they finish or are stopped; every sequence has its own token
budget, sampling parameters and optional constraint (a grammar, a reasoning budget). Model work
runs on one dedicated thread (``workers.engine.scheduler``), which also warms the model up (compiling
its decoding step where that is switched on) before the first step; this event-loop side hands
sequences over and delivers each step's tokens to the sequences' sinks, which turn them into
events. Why this is our own loop: docs/performance.md, "Why our own step loop".
"""

import asyncio
import logging
import threading
from typing import Literal

import torch
from tokenizers import Tokenizer

from workers.engine.generation import Finish, Generation, Sink
from workers.engine.sampling import TokenChooser
from workers.engine.scheduler import Produced, Scheduler
from workers.model.build import slot_model
from workers.model.decoder import Decoder
from workers.model.loader import LoadedModel
from workers.model.plan import Chunk, Feed, SlotModel, StepPlan

__all__ = ["Engine", "Finish", "Generation", "Sink"]

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, loaded: LoadedModel, *, compile: bool | Literal["auto"] | None = None,
                 launch_ahead: bool | None = None, model: SlotModel | None = None) -> None:
        """``compile``: in place of the model's setting; ``launch_ahead``: start a decoding step before
        the last one's tokens are read (``workers.engine.scheduler``; None: on a GPU, where the device
        would wait for the host meanwhile; on a CPU the same thread does both, and it only delays
        tokens); ``model``: the steps' model in place of the loaded one's (a benchmark's simulated
        model: ``bench.simulated``)."""
        spec = loaded.spec
        self.loaded = loaded
        wanted = spec.compile if compile is None else compile
        self.compile = loaded.device.type == "cuda" if wanted == "auto" else wanted
        self.model = slot_model(loaded, self.compile) if model is None else model
        vocab = max(self.model.vocab, Tokenizer.from_str(loaded.card.tokenizer_json).get_vocab_size())
        self.launch_ahead = loaded.device.type == "cuda" if launch_ahead is None else launch_ahead
        self._scheduler = Scheduler(self.model, TokenChooser(self.model.slots, vocab, loaded.device),
                                    spec.context_window, spec.id,
                                    reuse_prefixes=spec.reuse_prefixes and self.model.keeps_prefixes,
                                    copy_beside_steps=loaded.device.type == "cpu", launch_ahead=self.launch_ahead)
        self._warm = threading.Event()
        self._warm_error: BaseException | None = None

    def submit(self, seq: Generation) -> None:
        self._scheduler.add(seq)

    def stop(self, seq: Generation, reason: Finish, error: BaseException | None = None) -> None:
        """Stop a sequence: its sink gets ``on_finish(reason, error)`` soon, on the event loop, and no
        token after this call."""
        if seq.finish_reason is not None or seq.stop_requested is not None:
            return
        seq.request_stop(reason)
        self._scheduler.wake()  # frees its slot at the next step
        asyncio.get_running_loop().call_soon(self._finish, seq, reason, error)

    async def run(self) -> None:
        """Warm up, then run steps on the model thread until cancelled (see ``ready``)."""
        loop = asyncio.get_running_loop()

        def deliver(produced: list[Produced]) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._dispatch, produced)

        self._scheduler.start(deliver, warm_up=self._warm_up)
        await asyncio.Future()  # the work happens on the model thread

    async def ready(self) -> None:
        """Return once the model is warm (raises what warming up raised)."""
        await asyncio.to_thread(self._warm.wait)
        if self._warm_error is not None:
            raise self._warm_error

    def take_step_sizes(self) -> dict[int, int]:
        """Steps run since the last call, by how many sequences each ran (its batch size)."""
        return dict(self._scheduler.take_step_sizes())

    def occupancy(self) -> tuple[int, int, int]:
        """KV slots held by sequences, slots in all, and sequences waiting for a slot."""
        used, waiting = self._scheduler.occupancy()
        return used, self.model.slots, waiting

    def close(self) -> None:
        self._scheduler.close()

    # --- event-loop side ----------------------------------------------------------------------

    def _dispatch(self, produced: list[Produced]) -> None:
        try:
            for item in produced:
                seq = item.seq
                if seq.finish_reason is not None or seq.stop_requested is not None:
                    continue  # stopped by the loop: what the thread made meanwhile is dropped
                if item.token is not None:
                    seq.generated.append(item.token)
                    try:
                        seq.sink.on_token(seq, item.token, item.scores)
                    except Exception as exc:  # one sequence's failure must not end the others'
                        logger.exception("a sequence's token handler failed; failing the sequence")
                        self.stop(seq, Finish.ERROR, exc)
                        continue
                    if seq.stop_requested is not None:
                        continue  # the sink stopped it (a stop string): finished by stop()
                if item.reason is not None:
                    self._finish(seq, item.reason, item.error)
        finally:
            self._scheduler.delivered()

    def _finish(self, seq: Generation, reason: Finish, error: BaseException | None) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            seq.sink.on_finish(seq, reason, error)

    # --- model thread, before the first step -----------------------------------------------------

    def _warm_up(self) -> None:
        try:
            warm_up(self.model, self.compile)
            if isinstance(self.model, Decoder):  # after steps: the output layer's codes are in place
                weights, position = self.model.step_bytes(0), self.model.cache.position_bytes
                logger.info("model %s: a decoding step reads %.1f MB of weights and %.1f KB of keys and values a "
                            "position", self.loaded.spec.id, weights / 1e6, position / 1e3)
        except BaseException as exc:
            logger.exception("model %s: warming up failed", self.loaded.spec.id)
            self._warm_error = exc
            raise
        finally:
            self._warm.set()


@torch.inference_mode()
def warm_up(model: SlotModel, compile: bool) -> None:
    """Run a few steps of every kind the engine runs, so that the first request does not pay for
    compiling (with ``compile``: one decoding step of each batch-size bucket, and of two attention
    lengths) or for the kernels' first use."""
    sizes = sorted({min(model.slots, 1 << i) for i in range(model.slots.bit_length() + 1)})
    for rows in sizes if compile else [1, min(2, model.slots)]:
        for position in (1, 3):
            model.run(StepPlan(feeds=[Feed(slot, 0, position) for slot in range(rows)]))
    model.run(StepPlan(chunks=[Chunk(0, 0, [0] * 4, True)]))
    if model.slots > 1:
        model.run(StepPlan(feeds=[Feed(0, 0, 4)], chunks=[Chunk(1, 0, [0] * 3, False)]))
    for slot in range(min(2, model.slots)):
        model.release(slot)

