"""A weight's 4-bit and 8-bit groups, as GGUF's Q4_1 and Q8_0 hold them, and their layouts for the
CPU kernels that multiply them: torch's 4-bit kernel (``for_torch``) and ``kernels.c``'s products
(``Groups4.for_kernels_c``, ``in_blocks``, ``scales_in_blocks``)."""

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional

GROUP = 32  # inputs per scale of 4-bit and 8-bit weights (as in GGUF's Q4 and Q8 formats)
F16_TINY = 2.0 ** -24  # float16's smallest step: a group's least scale
F16_MAX = 65504.0


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
