"""Decoding steps replayed from CUDA graphs, captured by hand: one graph per batch-size bucket and
attention-length block, the first time that shape runs (the engine's warm-up captures the common
ones). A replay costs one copy of the step's inputs and one launch, far less host work per step than
``torch.compile(mode="reduce-overhead")`` spends on the same step (docs/performance.md, "On a GPU").
The graphs share one memory pool: they run one at a time on one stream, and each output is read
before the next replay.
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
        # pinned staging of a step's inputs, then of the rows fed on the device and the rows wanted:
        # two, as a step may be launched before the last one's tokens are read (``TokenChooser.launch``);
        # a copy from pageable memory would wait for the steps under way
        self._host = [torch.empty(6 * rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._rows = torch.empty(2 * rows, dtype=torch.int64, device=columns.device)
        self._runs = 0
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def run(self, inputs: np.ndarray, length: int, wanted: np.ndarray,
            fed: tuple[np.ndarray, Tensor] | None = None) -> Tensor:
        """Logits of the rows ``wanted``, from ``inputs`` ``[4, rows]`` (tokens, positions, slots,
        last attended column) attending to the first ``length`` columns; ``fed``: rows and their
        tokens, on the device, in place of those ``inputs`` give. The result may be a view that the
        next replay overwrites: read it (index it) before."""
        rows = inputs.shape[1]
        graph = self._graphs.get((rows, length)) or self._capture(rows, length)
        host = self._host[self._runs % 2]
        self._runs += 1
        staged = host[:4 * rows].view(4, rows)
        staged.numpy()[...] = inputs
        # a buffer is written again two replays later, when this step's tokens have come back (a
        # sync behind these copies)
        graph.inputs.copy_(staged, non_blocking=True)
        if fed is not None:
            graph.inputs[0].index_copy_(0, self._staged_rows(host, 4 * rows, fed[0], 0), fed[1])
        graph.graph.replay()
        if np.array_equal(wanted, np.arange(len(wanted))):
            return graph.output[:len(wanted)]
        return graph.output[self._staged_rows(host, 5 * rows, wanted, rows)]

    def _staged_rows(self, host: Tensor, at: int, rows: np.ndarray, into: int) -> Tensor:
        """``rows`` on the device, through ``host[at:]``, in ``self._rows[into:]``."""
        staged = host[at:at + len(rows)]
        staged.numpy()[...] = rows
        device = self._rows[into:into + len(rows)]
        device.copy_(staged, non_blocking=True)
        return device

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
