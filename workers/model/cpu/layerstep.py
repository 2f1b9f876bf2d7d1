"""A step's layers in one ``kernels.c`` call (``layers_*``), where every part of them runs there.

With the kernels on a CPU, a one-stream step spent much of its time in Python between them: some
160 calls a layer (the norm, the fused product, the rotation with the cache writes, the attention,
the output projection and the residual, the norm, the gate and up product, the activation, the down
product and the residual; docs/performance.md, "CPU kernels"). Where each layer's four products run
on 4-bit groups through ``kernels.c`` or on a GGUF file's blocks through ``blocks.c``, for all of a
step's rows (no more rows than every product takes: ``int4_rows``, ``BlockProduct.rows_on_blocks``),
without biases, and its norms, rotation, attention and activation run in ``kernels.c``, the layer loop
runs in C: the same functions in the same order on the same rows, so the same hidden states bit for
bit (``tests/engine/test_slots.py``, ``tests/engine/test_blocks.py``). Other steps (more rows, a model
that norms its queries and keys, torch's products) take the Python loop.
"""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from workers.model.cpu import kernels
from workers.model.cpu.attention import StepRows
from workers.model.cpu.blocks import BlockProduct

FUNCTIONS = {torch.bfloat16: "layers_bf16", torch.float16: "layers_f16", torch.float32: "layers_f32"}
# where each field of kernels.c's layer_table starts in a row of the table (8 bytes a field): the norms,
# the 4-bit products' codes, scales and minimums, the cache, then blocks_matmul and its parts and counts
NORMS, CODES, SCALES, MINIMUMS, CACHE, ON_PARTS, PARTS, COUNTS, WIDTH = 0, 2, 6, 10, 14, 16, 17, 21, 25


class LayerParts(NamedTuple):
    """What ``layers_*`` reads of one layer."""

    input_norm: Tensor
    post_norm: Tensor
    products: Sequence[kernels.GroupedWeights | BlockProduct]  # qkv, o, gate and up, down: all of one kind
    keys: Tensor  # the layer's cache, ``[slots, kv_heads, positions, head_dim]``
    values: Tensor


class LayerStep:
    """A model's layers as ``kernels.c``'s ``layers_*`` takes them: a table of pointers per layer
    (norms, the four products' codes, scales and minimums or their blocks, keys and values), built
    once; the step's rows go in at each call."""

    def __init__(self, built: kernels.Kernels, layers: Sequence[LayerParts], heads: int, eps: float,
                 tables: tuple[Tensor, Tensor], rows: int) -> None:
        """``tables``: the float32 rotation tables (kept alive: the kernel reads them); ``rows``: the
        most rows a step may have here (the layers' ``int4_rows``)."""
        keys = layers[0].keys
        slots, kv_heads, positions, head_dim = keys.shape
        _, o, _, down = layers[0].products
        self.rows = rows
        self._built, self._eps, self._scale = built, eps, head_dim ** -0.5
        self._function = built.functions[FUNCTIONS[keys.dtype]]
        self._tables = tables
        self._shape = np.asarray([o.n, heads, kv_heads, head_dim, down.k, slots, positions], dtype=np.int64)
        table = np.zeros((len(layers), WIDTH), dtype=np.uint64)
        for i, layer in enumerate(layers):
            table[i, NORMS:NORMS + 2] = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            table[i, CACHE:CACHE + 2] = layer.keys.data_ptr(), layer.values.data_ptr()
            for j, product in enumerate(layer.products):
                if isinstance(product, BlockProduct):
                    table[i, ON_PARTS], table[i, PARTS + j], table[i, COUNTS + j] = product.call
                else:
                    table[i, CODES + j], table[i, SCALES + j], table[i, MINIMUMS + j] = product.pointers
        self._grouped = any(isinstance(product, kernels.GroupedWeights) for layer in layers
                            for product in layer.products)
        self._table, self._layers = table, len(layers)

    @property
    def limit(self) -> int:
        """The most rows a step runs here now (0 where torch's threads leave the kernels the slower choice)."""
        products = not self._grouped or self._built.products_run_here()
        return self.rows if products and kernels.runs_here("attend") else 0

    @property
    def cheapest_rows(self) -> int:
        """``ModelStep.one_call_rows``: the most rows a step runs here before its cost jumps, that of 4-bit
        groups (more rows run dense); 0 on a file's blocks, whose products take more rows in the Python
        loop at no jump (float rows on float32 tiles: cheaper a row)."""
        return self.limit if self._grouped else 0

    def takes(self, rows: int, attending: StepRows | None) -> bool:
        """Whether a step of ``rows`` rows, all attending through the kernel (``attending``), runs here."""
        return 0 < rows <= self.limit and attending is not None and attending.count == rows \
            and attending.within(int(self._shape[5]))

    def __call__(self, x: Tensor, stored: tuple[np.ndarray, np.ndarray], attending: StepRows) -> Tensor:
        """The hidden states after the last layer of the embeddings ``x`` (float32 ``[rows, hidden]``,
        overwritten), each row written at its position and slot (``stored``) and attending as
        ``attending`` says (``takes``)."""
        positions, slots = (np.ascontiguousarray(array, dtype=np.int64) for array in stored)
        rows = x.shape[0]
        if not x.is_contiguous() or x.dtype != torch.float32 or positions.shape != (rows,) \
                or slots.shape != (rows,):
            raise ValueError(f"layers_* does not take rows {tuple(x.shape)} ({x.dtype})")
        cos, sin = self._tables
        status = self._function(
            x.data_ptr(), rows, self._table.ctypes.data, self._layers, self._shape.ctypes.data, self._eps,
            self._scale, cos.data_ptr(), sin.data_ptr(), positions.ctypes.data, slots.ctypes.data,
            *attending.pointers, attending.scratch.data_ptr())
        if status == -2:
            raise MemoryError("kernels.c: no memory for a step's layers")
        if status != 0:
            raise ValueError(f"layers_*: a position, slot or limit outside the cache {tuple(self._shape[5:])}")
        return x

