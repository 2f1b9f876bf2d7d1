"""A linear layer's weights, held in the form this host multiplies fastest.

- Dense: ``functional.linear``.
- Prepacked for the CPU's matrix library (``prepack``): oneDNN's blocked layout for bfloat16, MKL's
  for float32, laid out once rather than at every product.
- 4-bit groups (``pack_int4``, CPU): products of at most ``rows`` rows (decoding steps; how many pay
  is measured per CPU: ``precision.int4_rows``) use torch's 4-bit kernel, which reads an eighth of
  the bytes of float32 weights and a quarter of bfloat16 ones. Its only vectorised path takes
  bfloat16 activations, scales and zero points, so a float32 model's decoding products run in
  bfloat16 too, their sums in float32.
- The same 4-bit groups through ``kernels.c`` instead (``pack_int4``'s ``native``, where it is built
  with AVX2 or AVX512-VNNI and torch runs on one thread when the model is packed): the inputs
  quantised to 8 bits per 32 and multiplied with the codes as integers, as llama.cpp does, rather
  than every weight converted to float. Then torch's packing is not made at all (it cost a worker's
  start time and a second copy of the codes).
- 8-bit groups (``pack_int8``, CPU), as GGUF's Q8_0 holds them (codes -127..127 and a scale per
  group): torch has no kernel for them, so each code is split into its two 4-bit halves and the
  same 4-bit kernel runs one product over the inputs twice, the high halves' groups scaled by 16:
  every weight comes back as its code times its (bfloat16) scale, and the sum is rounded once.
"""

from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional

from workers.model.cpu.groups import GROUP, Groups8

PREFILL_ROWS = 32  # the product size prepacked layers are laid out for


class NativeProduct(Protocol):
    """A product ``kernels.c`` runs on its own copy of the weights (``kernels.GroupedWeights``)."""

    def __call__(self, x: Tensor) -> Tensor: ...

    @property
    def nbytes(self) -> int:
        """What a product reads of the weights: codes, scales (and minimums)."""

    @property
    def kind(self) -> str:
        """What it multiplies, in words."""


def frozen(tensor: Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach(), requires_grad=False)


def can_prepack(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch._C._has_mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32 and bool(torch._C.has_mkl)


class Linear(nn.Module):
    """``x @ weight.T + bias`` for 2-D ``x``."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = frozen(weight)
        self.bias = None if bias is None else frozen(bias)
        self.prepacked: Tensor | None = None
        self.rows_hint = 0
        self.int4: Tensor | None = None
        self.scales_zeros: Tensor | None = None
        self.int4_rows = 0
        self.merge_rows = 0  # decoding rows a dense chunk product takes along (``forward``)
        self.inputs_twice = False  # 8-bit groups: the inputs go in twice (``pack_int8``)
        self.native: NativeProduct | None = None  # the 4-bit groups through kernels.c (``pack_int4``)

    @property
    def packed(self) -> bool:
        """Whether products of up to ``int4_rows`` rows run on 4-bit or 8-bit groups."""
        return self.int4 is not None or self.native is not None

    @property
    def packing(self) -> str:
        """What the decoding products run on, in words."""
        if self.native is not None:
            return self.native.kind
        return "dense weights" if not self.packed else "8-bit groups" if self.inputs_twice else "4-bit groups"

    @property
    def decoding_bytes(self) -> int:
        """Bytes a product of one row reads: the 4-bit or 8-bit groups where it runs on them, else the
        dense weights (a prepacked layout holds as many)."""
        if self.native is not None:
            read = self.native.nbytes
        elif self.int4 is not None and self.scales_zeros is not None:
            read = self.int4.nbytes + self.scales_zeros.nbytes
        else:
            read = self.weight.nbytes
        return read + (0 if self.bias is None else self.bias.nbytes)

    def prepack(self, rows_hint: int) -> None:
        """Lay the weights out for the CPU's matrix library, for products of about ``rows_hint`` rows
        (``can_prepack`` says where)."""
        self.rows_hint = rows_hint
        if self.weight.dtype == torch.bfloat16:
            self.prepacked = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows_hint)
        else:
            self.prepacked = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows_hint)

    def pack_int4(self, packed: NativeProduct | tuple[Tensor, Tensor], rows: int, merge_rows: int = 0) -> None:
        """Products of at most ``rows`` rows on this layer's 4-bit groups: ``packed``, ``kernels.c``'s
        product on its copy of them or their packing for torch's kernel (``Groups4.for_torch``); a
        dense product of prompt rows takes up to ``merge_rows`` decoding rows along."""
        if isinstance(packed, tuple):
            self.int4, scales_zeros = packed
            self.scales_zeros = scales_zeros.to(torch.bfloat16)
            self.native = None
        else:
            self.native = packed
        self.int4_rows = rows
        self.merge_rows = merge_rows

    def pack_int8(self, rows: int, groups: "Groups8 | None") -> None:
        """This layer's 8-bit ``groups`` (None where ``kernels.c`` multiplies their codes, not this
        layer: ``OutputLayer._int8_logits``) for products of at most ``rows`` rows."""
        if groups is not None:
            self.int4, scales_zeros = groups.for_torch()
            self.scales_zeros = scales_zeros.to(torch.bfloat16)
        self.int4_rows = rows
        self.inputs_twice = True

    def forward(self, x: Tensor, decoding: int = 0, cast: bool = True) -> Tensor:
        """``decoding``: how many of the first rows are decoding rows (the rest: prompt chunks). Where
        all rows are too many for the 4-bit weights, each of the two parts runs on them if it is few
        enough, so that a step with chunks costs its decoding step plus its chunks, no more, and a
        small chunk does not read the dense weights; but a chunk that runs dense anyway takes up to
        ``merge_rows`` decoding rows along (where that was measured cheaper than their own 4-bit
        pass: ``precision.merge_rows``), and decoding rows too many for the 4-bit weights go in one
        dense product with the chunk's (two would read the dense weights twice). ``cast``: in the
        weights' dtype; without it, a 4-bit product stays in bfloat16 (for a caller that adds it to a
        float32 sum anyway: one operator fewer)."""
        rows = x.shape[0]
        if self.packed and self.int4_rows < rows and 0 < decoding < rows:
            chunk_dense = rows - decoding > self.int4_rows
            if decoding > self.int4_rows or (chunk_dense and decoding <= self.merge_rows):
                return self._dense(x)
            return torch.cat((self._product(x[:decoding], cast), self._product(x[decoding:], cast)))
        return self._product(x, cast)

    def _product(self, x: Tensor, cast: bool = True) -> Tensor:
        if self.packed and x.shape[0] <= self.int4_rows:
            return self._int4(x, cast)
        return self._dense(x)

    def _dense(self, x: Tensor) -> Tensor:
        x = x.to(self.weight.dtype)
        if self.prepacked is None or torch.compiler.is_compiling():  # a compiled graph takes plain weights
            return functional.linear(x, self.weight, self.bias)
        if self.weight.dtype == torch.bfloat16:
            y: Tensor = torch.ops.mkldnn._linear_pointwise(x, self.prepacked, self.bias, "none", [], "")
        else:
            y = torch.ops.mkl._mkl_linear(x, self.prepacked, self.weight, self.bias, self.rows_hint)
        return y

    def _int4(self, x: Tensor, cast: bool) -> Tensor:
        if self.native is not None:
            y = self.native(x)  # float32
        else:
            assert self.int4 is not None and self.scales_zeros is not None
            y = int4_product(x, self.int4, self.scales_zeros, self.inputs_twice)
        if cast:
            y = y.to(self.weight.dtype)
        return y if self.bias is None else y + self.bias


def int4_product(x: Tensor, codes: Tensor, scales_zeros: Tensor, inputs_twice: bool = False) -> Tensor:
    """``x @ w.T`` of 4-bit weights (``Groups4.for_torch``, scales and zeros in bfloat16; ``inputs_twice``:
    8-bit groups, ``Groups8.for_torch``), in bfloat16."""
    x = x.to(torch.bfloat16)
    if inputs_twice:
        x = torch.cat((x, x), dim=-1)
    return torch._weight_int4pack_mm_for_cpu(x, codes, GROUP, scales_zeros)
