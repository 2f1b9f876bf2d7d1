"""Decoding steps replayed from CUDA graphs, captured by hand: one graph per batch-size bucket and
attention-length block, the first time that shape runs (the engine's warm-up captures the common
ones). A replay costs one copy of the step's inputs and one launch, where running the same step
through ``torch.compile(mode="reduce-overhead")`` measured 1.4 ms of host work per step on an H200
(docs/performance.md). The graphs share one memory pool: they run one at a time on one stream, and
each output is read before the next replay.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# tokens, positions, slots, and the last column each row attends to
Step = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: Tensor  # [4, rows] on the device: what each replay reads
    output: Tensor  # what each replay writes


class StepGraphs:
    def __init__(self, step: Step, columns: Tensor, rows: int) -> None:
        """``step(tokens, positions, slots, mask)``: logits of every row; ``columns``: the
        positions of a slot (``arange(window)`` on the device)."""
        self._step = step
        self._columns = columns
        self._pool = torch.cuda.graph_pool_handle()
        self._host = torch.empty(4 * rows, dtype=torch.int64, pin_memory=True)
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def run(self, inputs: np.ndarray, length: int) -> Tensor:
        """Logits of every row, from ``inputs`` ``[4, rows]`` (tokens, positions, slots, last
        attended column) attending to the first ``length`` columns. The result is overwritten by
        the next replay: read it (index it) before."""
        rows = inputs.shape[1]
        graph = self._graphs.get((rows, length)) or self._capture(rows, length)
        staged = self._host[:4 * rows].view(4, rows)
        staged.numpy()[...] = inputs
        # the host buffer is written again only after the step's tokens came back (a sync)
        graph.inputs.copy_(staged, non_blocking=True)
        graph.graph.replay()
        return graph.output

    def _capture(self, rows: int, length: int) -> _Graph:
        scratch = self._columns.numel() - 1  # dummy rows write and read only a slot's last position
        inputs = torch.stack([torch.zeros(rows, dtype=torch.int64, device=self._columns.device),
                              torch.full((rows,), scratch, device=self._columns.device),
                              torch.arange(rows, device=self._columns.device),
                              torch.full((rows,), scratch, device=self._columns.device)])

        def body() -> Tensor:
            mask = (self._columns[:length][None, :] <= inputs[3][:, None])[:, None, None, :]
            return self._step(inputs[0], inputs[1], inputs[2], mask)

        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiling, autotuning and library handles happen outside the capture
            body()
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = body()
        captured = _Graph(graph, inputs, output)
        self._graphs[(rows, length)] = captured
        return captured
