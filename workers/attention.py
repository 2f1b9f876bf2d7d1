"""A step's attention on a CPU, through ``kernels.c`` (``attend_*``): every decoding row and every
prompt chunk's rows, in one call per layer.

For few query rows per sequence, torch's ``scaled_dot_product_attention`` on a CPU costs several times
what reading the keys and values does (SmolLM2, bfloat16, one thread, on an AVX512-BF16 EPYC: one
decoding row 27 us a layer at 64 positions, 326 at 1,500, the kernel 9 and 106), and it was most of
what made a long generation's last tokens slower than its first. The kernel runs each decoding row
against its own slot up to its own last position (no mask), the queries of one key head's group
sharing every key and value as it is read, in float32 arithmetic. A chunk's rows (consecutive rows of
one slot) attend as blocks of up to 16 rows whose queries share each key and value, with the
arithmetic blocked for AVX512 (``kernels.c``, "Blocks"): torch's attention took 3-5x as long for
chunks of every size measured (16 tokens at position 1,000: 712 us a layer against 233; 512 tokens
from the start: 8.0 ms against 1.7), so every chunk goes through the kernel, beside decoding or alone.
It runs where torch runs on at most two threads (``kernels.MAX_THREADS``; the default on a 2-core
host is one); with more, torch's attention runs the heads in parallel. Where torch's threads leave a
core (``kernels.helper_fits``), the key heads of decoding rows of ``kernels.HELPER_MIN_LENGTH``
positions or more are shared with a helper thread of ``kernels.c``, which reads the next layer's
keys and values ahead while the model's thread runs the layer's products: one stream at 1,500
positions on a 2-core AMX Xeon, a step 4.8 ms slower than at 100 positions alone, 2.2 ms with the
helper (the results bit for bit the same; docs/performance.md).
"""

import numpy as np
import torch
from torch import Tensor

from workers import kernels

MAX_GROUP, MAX_DIM = 16, 256  # as in kernels.c
_FUNCTIONS = {torch.bfloat16: "attend_bf16", torch.float16: "attend_f16", torch.float32: "attend_f32"}


class DecodeAttention:
    """``attend_*`` for one model's shapes."""

    def __init__(self, built: kernels.Kernels, group: int, positions: int) -> None:
        self.group, self.positions = group, positions
        self._scores = torch.empty(group * positions, dtype=torch.float32)  # one call at a time
        self._functions = {dtype: built.functions[name] for dtype, name in _FUNCTIONS.items()}
        if kernels.helper_fits():
            built.configure_helper(kernels.HELPER_MIN_LENGTH)

    def supports(self, q: Tensor, keys: Tensor) -> bool:
        """Whether ``__call__`` takes these queries and keys (its scratch holds ``positions`` per query)."""
        return q.dtype == keys.dtype and q.dtype in self._functions and keys.is_contiguous() \
            and q.shape[1] == self.group * keys.shape[1] and keys.shape[2] <= self.positions \
            and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and kernels.runs_here("attend")

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, slots: np.ndarray, limits: np.ndarray,
                 following: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``q`` ``[rows, heads, head_dim]``, ``keys``/``values`` ``[slots, kv_heads, positions, head_dim]``
        (contiguous); row ``r`` attends to positions ``0..limits[r]`` of slot ``slots[r]`` (int64).
        ``following``: the next layer's keys and values (the same shape), which the helper thread
        reads ahead (None at a step's last layer). Returns ``[rows, heads * head_dim]``."""
        rows, heads, head_dim = q.shape
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        limits = np.ascontiguousarray(limits, dtype=np.int64)
        if not self.supports(q, keys) or values.shape != keys.shape or not values.is_contiguous() \
                or slots.shape != (rows,) or limits.shape != (rows,) \
                or (rows and (slots.min() < 0 or slots.max() >= keys.shape[0])) \
                or (following is not None and any(t.shape != keys.shape or t.dtype != keys.dtype
                                                  or not t.is_contiguous() for t in following)):
            raise ValueError(f"attend does not take queries {tuple(q.shape)}, keys {tuple(keys.shape)}")
        kv_heads = keys.shape[1]
        out = torch.empty((rows, heads * head_dim), dtype=q.dtype)
        ahead = (None, None) if following is None else (following[0].data_ptr(), following[1].data_ptr())
        status = self._functions[q.dtype](
            q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), slots.ctypes.data, limits.ctypes.data,
            rows, kv_heads, heads // kv_heads, head_dim, keys.shape[2], head_dim ** -0.5, self._scores.data_ptr(),
            out.data_ptr(), *ahead)
        if status == -2:
            raise MemoryError("kernels.c: no memory for a block of chunk rows")
        if status != 0:
            raise ValueError(f"attend refused limits {limits.min()}..{limits.max()} for keys {tuple(keys.shape)}")
        return out


def decode_attention(built: kernels.Kernels | None, group: int, head_dim: int,
                     positions: int) -> DecodeAttention | None:
    """The kernel for a model of these shapes; None where there is none or it cannot run them."""
    if built is None or group > MAX_GROUP or head_dim > MAX_DIM:
        return None
    return DecodeAttention(built, group, positions)
