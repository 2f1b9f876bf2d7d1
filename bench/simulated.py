"""A worker whose model computes nothing: the event plane alone, at any rate (``bench.eventplane``).

The worker is the real one (arq, the claim, ``TaskRun``, the output path, the writer, the append
script), and so is its engine (the scheduler, its hand-off to the event loop); only the model's step
is simulated. Every row of a step gets the same token, one of 64 single characters chosen by the
step's number (``SYMBOLS``), and a step returns at most once every ``1 / rate`` seconds (rate 0: as
fast as the engine asks for steps). Each step's time and rows go to a log file that the benchmark
reads: a character a client receives names its step, modulo 64, so the client knows when the model
produced it (``production_time``).

    python -m bench.simulated --model ID --rate 150 --log FILE   (the worker process; Redis from LMSP_*)
"""

import argparse
import string
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lmsp_core.settings import load_settings
from workers import main as worker_main
from workers.engine.core import Engine
from workers.model.loader import LoadedModel
from workers.model.plan import StepPlan

SYMBOLS = string.ascii_letters + string.digits + "-_"  # one token each in SmolLM2's vocabulary
LOG_STEPS = 1 << 20  # steps the log has room for
CLOCK = time.perf_counter  # CLOCK_MONOTONIC: the same clock in every process of this host


def symbol_ids(tokenizer_json: str) -> list[int]:
    """The token id of each of ``SYMBOLS`` (each must be one token)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    ids = [tokenizer.encode(symbol, add_special_tokens=False).ids for symbol in SYMBOLS]
    if any(len(one) != 1 for one in ids):
        raise ValueError("the tokenizer does not hold every symbol as one token")
    return [one[0] for one in ids]


class StepLog:
    """Each step's time (``CLOCK``) and the tokens it produced, in a file shared with the benchmark."""

    def __init__(self, path: Path, mode: str = "r") -> None:
        self.rows = np.memmap(path, dtype=np.float64, mode=mode, shape=(LOG_STEPS, 2))  # type: ignore[call-overload]

    def record(self, step: int, produced: int) -> None:
        self.rows[step % LOG_STEPS] = (CLOCK(), produced)

    def steps(self) -> int:
        """How many steps are logged (times are never 0 once written)."""
        return int(np.count_nonzero(self.rows[:, 0]))

    def tokens_between(self, start: float, end: float) -> int:
        times, produced = self.rows[:, 0], self.rows[:, 1]
        return int(produced[(times > start) & (times <= end)].sum())


def production_time(times: np.ndarray, symbol: int, received: float) -> float | None:
    """When the model produced a character ``SYMBOLS[symbol]`` received at ``received``: the last step
    of that symbol before then (``times``: every logged step's time, in step order)."""
    candidates = times[symbol::len(SYMBOLS)]
    before = candidates[(candidates > 0) & (candidates <= received)]
    return float(before[-1]) if len(before) else None


class SimulatedModel:
    """A ``SlotModel`` that computes nothing (see the module's docstring)."""

    def __init__(self, slots: int, rate: float, log: StepLog, symbols: list[int]) -> None:
        self.slots = slots
        self.vocab = max(symbols) + 1
        self.keeps_prefixes = False  # every prompt is fed whole
        self.one_call_rows = 0
        self._symbols = symbols
        self._period = 1.0 / rate if rate else 0.0
        self._due = 0.0
        self._step = 0
        self._log = log

    def run(self, plan: StepPlan, fed: Tensor | None = None) -> Tensor:
        if self._period:
            now = CLOCK()
            if self._due > now:
                time.sleep(self._due - now)
            self._due = max(self._due, now) + self._period
        logits = torch.zeros(plan.outputs, self.vocab)
        logits[:, self._symbols[self._step % len(self._symbols)]] = 1.0
        self._log.record(self._step, len(plan.feeds) + sum(chunk.last for chunk in plan.chunks))
        self._step += 1
        return logits

    def release(self, slot: int) -> None:
        pass

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        raise AssertionError("keeps no prefixes")


def simulated_engine(rate: float, log: Path) -> worker_main.EngineFactory:
    def make(loaded: LoadedModel) -> Engine:
        symbols = symbol_ids(loaded.card.tokenizer_json)
        return Engine(loaded, model=SimulatedModel(loaded.spec.max_batch_size, rate, StepLog(log, "w+"), symbols))

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rate", type=float, default=150.0, help="steps a second (0: unpaced)")
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    worker_main.run(load_settings(), [args.model], simulated_engine(args.rate, args.log))


if __name__ == "__main__":
    main()
