"""A step's layers in one ``kernels.c`` call (``layers_*``), where every part of them runs there.

With the kernels on a CPU, a one-stream SmolLM2 step spent about a third of its time in Python between
them: some 160 calls a layer (the norm, the fused product, the rotation with the cache writes, the
attention, the output projection and the residual, the norm, the gate and up product, the
activation, the down product and the residual), 30 layers, 3.5 ms of 9.6 on the AVX512-BF16 EPYC of
family 25. Where each layer's four products run on 4-bit groups through ``kernels.c`` for all of a
step's rows (no more rows than every layer's ``int4_rows``), without biases, and its norms, rotation,
attention and activation run there too, the layer loop runs in C: the same functions in the same
order on the same rows, so the same hidden states bit for bit (``tests/e2e/test_slots.py``). Other
steps (more rows, a model that norms its queries and keys, torch's products) take the Python loop.
"""

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from workers import kernels
from workers.attention import StepRows

if TYPE_CHECKING:
    from workers.decoder import Decoder

_FUNCTIONS = {torch.bfloat16: "layers_bf16", torch.float16: "layers_f16", torch.float32: "layers_f32"}


class LayerStep:
    """The decoder's layers as ``kernels.c``'s ``layers_*`` takes them: a table of pointers per layer
    (``layer_table``: norms, the four products' codes, scales and minimums, keys and values), built
    once; the step's rows go in at each call."""

    def __init__(self, decoder: "Decoder", built: kernels.Kernels, products: list[list[kernels.GroupedWeights]],
                 rows: int) -> None:
        """``products``: each layer's qkv, o, gate and up, and down products."""
        heads, kv_heads, head_dim = decoder.shape
        keys = decoder.cache.layer(0)[0]
        self.rows = rows  # the most rows a step may have here (the layers' ``int4_rows``)
        self._built, self._eps, self._scale = built, decoder.eps, head_dim ** -0.5
        self._function = built.functions[_FUNCTIONS[keys.dtype]]
        assert decoder._rope_f32 is not None
        self._tables = decoder._rope_f32  # kept alive: the kernel reads them
        _, o, _, down = products[0]
        self._shape = np.asarray([o.n, heads, kv_heads, head_dim, down.k, keys.shape[0], keys.shape[2]],
                                 dtype=np.int64)
        table = np.zeros((len(products), 16), dtype=np.uint64)
        for i, (layer, four) in enumerate(zip(decoder.typed_layers, products, strict=True)):
            layer_keys, layer_values = decoder.cache.layer(i)
            table[i] = [layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                        *(product.pointers[0] for product in four), *(product.pointers[1] for product in four),
                        *(product.pointers[2] for product in four), layer_keys.data_ptr(), layer_values.data_ptr()]
        self._table, self._layers = table, len(products)

    @classmethod
    def of(cls, decoder: "Decoder") -> "LayerStep | None":
        """The decoder's layers in one call, where every part of them runs through ``kernels.c``; else None."""
        built, layers = decoder._kernels, decoder.typed_layers
        keys = decoder.cache.layer(0)[0]
        if built is None or decoder.attention is None or decoder._rope_store is None or decoder._rope_f32 is None \
                or not layers or keys.dtype not in _FUNCTIONS \
                or decoder.embed.dtype not in (torch.float32, keys.dtype):  # the attention's rounding: the model's
            return None
        products: list[list[kernels.GroupedWeights]] = []
        rows = min(linear.int4_rows for layer in layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
        for layer in layers:
            if layer.native_norm is None or layer.native_activation is None or layer.q_norm is not None:
                return None
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            four = [native for linear in linears if linear.bias is None
                    and isinstance(native := linear.native, kernels.GroupedWeights) and native.bits == 4]
            if len(four) != len(linears):
                return None
            products.append(four)
        return cls(decoder, built, products, rows) if rows else None

    @property
    def limit(self) -> int:
        """The most rows a step runs here now (0 where torch's threads leave the kernels the slower choice)."""
        return self.rows if self._built.products_run_here() and kernels.runs_here("attend") else 0

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

