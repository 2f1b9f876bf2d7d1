"""A linear layer's weights, held in the form this host multiplies fastest.

- Dense: ``functional.linear``.
- Prepacked for the CPU's matrix library (``prepack``): oneDNN's blocked layout for bfloat16, MKL's
  for float32, laid out once rather than at every product (a bfloat16 product of one row through
  SmolLM2's output layer took half the time).
- 4-bit groups (``pack_int4``, CPU): products of at most ``rows`` rows (decoding steps; how many pay
  is measured per CPU: ``precision.int4_rows``) use torch's 4-bit kernel, which reads an eighth of
  the bytes of float32 weights and a quarter of bfloat16 ones. Its only vectorised path takes
  bfloat16 activations, scales and zero points, so a float32 model's decoding products run in
  bfloat16 too, their sums in float32.
- The same 4-bit groups through ``kernels.c`` instead (``pack_int4``'s ``native``, where it is built
  with AVX2 or AVX512-VNNI and torch runs on one thread when the model is packed): the inputs
  quantised to 8 bits per 32 and multiplied with the codes as integers, as llama.cpp does, rather
  than every weight converted to float. Then torch's packing is not made at all (it cost a worker's
  start seconds and a second copy of the codes).
- 8-bit groups (``pack_int8``, CPU), as GGUF's Q8_0 holds them (codes -127..127 and a scale per
  group): torch has no kernel for them, so each code is split into its two 4-bit halves and the
  same 4-bit kernel runs one product over the inputs twice, the high halves' groups scaled by 16:
  every weight comes back as its code times its (bfloat16) scale, and the sum is rounded once.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional

GROUP = 32  # inputs per scale of 4-bit weights (as in GGUF's Q4 formats)
F16_TINY = 2.0 ** -24  # float16's smallest step: a group's least scale
F16_MAX = 65504.0


class NativeProduct(Protocol):
    """A product ``kernels.c`` runs on its own copy of the weights (``kernels.GroupedWeights``)."""

    def __call__(self, x: Tensor) -> Tensor: ...

    @property
    def nbytes(self) -> int:
        """What a product reads of the weights: codes, scales (and minimums)."""


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
    8-bit groups, ``int8_groups``), in bfloat16."""
    x = x.to(torch.bfloat16)
    if inputs_twice:
        x = torch.cat((x, x), dim=-1)
    return torch._weight_int4pack_mm_for_cpu(x, codes, GROUP, scales_zeros)


def in_groups(weight: Tensor) -> Tensor:
    """``weight`` ``[rows, cols]`` as float32 ``[rows, cols / GROUP, GROUP]``."""
    rows, cols = weight.shape
    return weight.float().view(rows, cols // GROUP, GROUP)


@dataclass(frozen=True)
class Groups4:
    """A weight's 4-bit groups as llama.cpp's Q4_1 quantises and holds them (``w = code * scale + low``,
    codes 0..15, each group's range in 15 steps, scale and low in float16, so that a Q4_1 GGUF's
    weights come back exactly): quantised once (a worker's start packs 120 of SmolLM2's), then checked
    and laid out for each kernel from that. ``codes`` ``[rows, groups, GROUP]`` (float32), ``scale``
    and ``low`` ``[rows, groups]`` (float32 holding float16 values: ``kernels.c`` reads them as
    float16, a sixth fewer bytes of a step's weights than float32 scales)."""

    codes: Tensor
    scale: Tensor
    low: Tensor

    @classmethod
    def of(cls, weight: Tensor) -> "Groups4":
        groups = in_groups(weight)
        low, high = as_float16(groups.amin(-1)), groups.amax(-1)
        scale = as_float16(((high - low) / 15).clamp(min=F16_TINY))
        return cls(((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15), scale, low)

    def exact(self, weight: Tensor) -> bool:
        """Whether they represent ``weight`` (float32) exactly, as torch's kernel restores them."""
        zero = self.low + 8 * self.scale
        restored = (self.codes - 8) * self.scale[..., None] + zero[..., None]
        return bool(torch.equal(restored.view(weight.shape), weight))

    def for_torch(self) -> tuple[Tensor, Tensor]:
        """Packed for torch's CPU kernel, with each group's scale and zero point ``[groups, rows, 2]``
        (float32): ``w = (code - 8) * scale + zero``."""
        rows, groups, _ = self.codes.shape
        scales_zeros = torch.stack([self.scale, self.low + 8 * self.scale], dim=-1).transpose(0, 1).contiguous()
        codes = self.codes.view(rows, groups * GROUP).to(torch.int32)
        return torch._convert_weight_to_int4pack_for_cpu(codes, 1), scales_zeros

    def for_kernels_c(self, block: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Laid out for ``kernels.c``'s ``int4_product``: a row at a time (``block`` 0: codes packed two
        groups to 32 bytes, byte ``j``: code ``j`` of the first group, low nibble, and of the second; a
        last odd group in 16 bytes, byte ``j``: codes ``j`` and ``j + 16``; scales and minimums ``[rows,
        groups]``), or in blocks of ``block`` rows (8 or 16: ``kernels.c``, "The blocks"; the rows padded
        with zeros to a multiple of ``block``, scales and minimums ``[blocks, groups, block]``). Scales
        and minimums in float16, as Q4_1 holds them."""
        if block:
            return self._blocks(block)
        rows, groups, _ = self.codes.shape
        scale, low = self.scale.half(), self.low.half()
        codes = self.codes.to(torch.uint8)
        pairs = groups // 2
        packed = codes[:, :2 * pairs].view(rows, pairs, 2, GROUP)
        parts = [(packed[:, :, 0] | (packed[:, :, 1] << 4)).view(rows, pairs * GROUP)]
        if groups % 2:
            last = codes[:, -1]
            parts.append(last[:, :16] | (last[:, 16:] << 4))
        return torch.cat(parts, dim=1).contiguous(), scale.contiguous(), low.contiguous()

    def _blocks(self, block: int) -> tuple[Tensor, Tensor, Tensor]:
        """Codes ``[blocks, groups * 16 block]``: per group 4 steps of ``4 block`` bytes, byte ``4 r + t``
        of step ``s`` holding row ``r``'s code ``8 s + t`` (low nibble) and ``8 s + 4 + t`` (high)."""
        codes = in_blocks(self.codes.to(torch.uint8), block, 8)  # [blocks, groups, step, row, 8]
        packed = codes[..., :4] | (codes[..., 4:] << 4)
        return (packed.flatten(1).contiguous(), scales_in_blocks(self.scale.half(), block),
                scales_in_blocks(self.low.half(), block))


def as_float16(x: Tensor) -> Tensor:
    """``x`` (float32) rounded to float16's values, its range clamped to float16's (an infinity would
    make every weight of its group infinite or NaN)."""
    return x.clamp(-F16_MAX, F16_MAX).half().float()


def in_blocks(codes: Tensor, block: int, per_step: int) -> Tensor:
    """``codes`` ``[rows, groups, GROUP]`` in ``kernels.c``'s blocks of ``block`` rows (8 on AVX2, 16 on
    AVX512-VNNI), ``[blocks, groups, steps, block, per_step]``: each step ``per_step`` codes of each of
    the block's rows, the rows padded with zeros to a multiple of ``block``."""
    if block not in (8, 16) or GROUP != 32:
        raise ValueError(f"blocks of {block} rows: kernels.c takes 8 or 16 rows of groups of 32")
    rows, groups, _ = codes.shape
    padded = functional.pad(codes, (0, 0, 0, 0, 0, -rows % block))
    return padded.view(-1, block, groups, GROUP // per_step, per_step).permute(0, 2, 3, 1, 4)


def scales_in_blocks(scales: Tensor, block: int) -> Tensor:
    """Per-group ``scales`` ``[rows, groups]`` as ``kernels.c``'s blocks take them: ``[blocks, groups,
    block]``, the rows padded with zeros."""
    rows, groups = scales.shape
    padded = functional.pad(scales, (0, 0, 0, -rows % block))
    return padded.view(-1, block, groups).transpose(1, 2).contiguous()


def on_int4_grid(weight: Tensor) -> bool:
    """Whether 4-bit groups represent ``weight`` (float32) exactly."""
    return Groups4.of(weight).exact(weight)


@dataclass(frozen=True)
class Groups8:
    """A weight's 8-bit groups as llama.cpp's Q8_0 quantises and holds them (``w = code * scale``, codes
    -127..127 per group of ``GROUP``, the scale in float16): quantised once, then checked and laid out
    from that. ``values``: the codes ``[rows, groups, GROUP]`` (float32), ``scale`` ``[rows, groups]``
    (float32 holding float16 values, as ``Groups4``'s)."""

    values: Tensor
    scale: Tensor

    @classmethod
    def of(cls, weight: Tensor) -> "Groups8":
        groups = in_groups(weight)
        scale = as_float16((groups.abs().amax(-1) / 127).clamp(min=F16_TINY))
        return cls((groups / scale[..., None]).round().clamp(-127, 127), scale)

    def exact(self, weight: Tensor) -> bool:
        """Whether they represent ``weight`` (float32) exactly."""
        return bool(torch.equal((self.values * self.scale[..., None]).view(weight.shape), weight))

    def codes(self) -> tuple[Tensor, Tensor]:
        """The codes ``[rows, cols]`` (int8) and scales ``[rows, groups]`` (float32, float16's values): a
        quarter of the float32 weights' bytes, from which any of their rows comes back exactly."""
        rows, groups, _ = self.values.shape
        return self.values.view(rows, groups * GROUP).to(torch.int8), self.scale

    def for_torch(self) -> tuple[Tensor, Tensor]:
        """Laid out for torch's 4-bit kernel over the inputs twice: ``code + 128 = 16 * high + low``, the
        high halves in the first ``cols`` columns (scale ``16 * scale``, zero ``8 * scale``), the low
        ones in the next (scale ``scale``, zero 0), so that the two add up to ``code * scale`` (each
        ``(half - 8) * scale + zero``). Returns the packed codes and ``[2 * groups, rows, 2]`` scales and
        zeros (float32)."""
        rows, groups, _ = self.values.shape
        shifted = (self.values + 128).view(rows, groups * GROUP).to(torch.int32)
        halves = torch.cat((shifted // 16, shifted % 16), dim=1)
        scale = self.scale.transpose(0, 1)  # [groups, rows]
        scales_zeros = torch.cat((torch.stack([16 * scale, 8 * scale], dim=-1),
                                  torch.stack([scale, torch.zeros_like(scale)], dim=-1))).contiguous()
        return torch._convert_weight_to_int4pack_for_cpu(halves, 1), scales_zeros


def on_int8_grid(weight: Tensor) -> bool:
    """Whether 8-bit groups (``Groups8``) represent ``weight`` (float32) exactly."""
    return Groups8.of(weight).exact(weight)


def int8_groups(weight: Tensor) -> tuple[Tensor, Tensor]:
    """8-bit groups of ``weight`` laid out for torch's 4-bit kernel over the inputs twice
    (``Groups8.for_torch``)."""
    return Groups8.of(weight).for_torch()


def int8_codes(weight: Tensor) -> tuple[Tensor, Tensor]:
    """The 8-bit codes (int8) and scales (float32) of ``weight`` (``Groups8.codes``)."""
    return Groups8.of(weight).codes()


def int4_native(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """4-bit groups of ``weight`` for ``kernels.c``'s ``int4_product`` (``Groups4.for_kernels_c``)."""
    return Groups4.of(weight).for_kernels_c()
