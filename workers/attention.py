"""Decoding rows' attention on a CPU, through ``kernels.c`` (``attend_*``).

For one query row per sequence, torch's ``scaled_dot_product_attention`` on a CPU costs about three
times what reading the keys and values does (SmolLM2, bfloat16, one thread, on an AVX512-BF16 EPYC:
27 us a layer at 64 positions, 326 at 1,500; the kernel 9 and 106), and it is most of what makes a long
generation's last tokens slower than its first. The kernel reads each key and value once for all
queries of its key head, up to the row's own last position (no mask), in float32 arithmetic. It is
single-threaded, so it runs where torch runs on at most two threads (``kernels.MAX_THREADS``; the
default on a 2-core host is one); with more, torch's attention runs the heads in parallel.
"""

import numpy as np
import torch
from torch import Tensor

from workers import kernels

MAX_GROUP, MAX_DIM = 16, 256  # as in kernels.c
_FUNCTIONS = {torch.bfloat16: "attend_bf16", torch.float32: "attend_f32"}


class DecodeAttention:
    """``attend_*`` for one model's shapes: ``__call__`` attends the first ``rows`` rows of queries."""

    def __init__(self, built: kernels.Kernels, group: int, positions: int) -> None:
        self.group, self.positions = group, positions
        self._scores = torch.empty(group * positions, dtype=torch.float32)  # one call at a time
        self._functions = {dtype: built.functions[name] for dtype, name in _FUNCTIONS.items()}

    def supports(self, q: Tensor, keys: Tensor) -> bool:
        """Whether ``__call__`` takes these queries and keys (its scratch holds ``positions`` per query)."""
        return q.dtype == keys.dtype and q.dtype in self._functions and keys.is_contiguous() \
            and q.shape[1] == self.group * keys.shape[1] and keys.shape[2] <= self.positions \
            and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and kernels.runs_here("attend")

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, limits: np.ndarray) -> Tensor:
        """``q`` ``[rows, heads, head_dim]`` (row ``r``: slot ``r``), ``keys``/``values`` ``[slots, kv_heads,
        positions, head_dim]`` (contiguous), ``limits``: the last position each row attends to (int64).
        Returns ``[rows, heads * head_dim]``."""
        if not self.supports(q, keys) or values.shape != keys.shape or not values.is_contiguous():
            raise ValueError(f"attend does not take queries {tuple(q.shape)}, keys {tuple(keys.shape)}")
        rows, heads, head_dim = q.shape
        kv_heads = keys.shape[1]
        out = torch.empty((rows, heads * head_dim), dtype=q.dtype)
        limits = np.ascontiguousarray(limits, dtype=np.int64)
        status = self._functions[q.dtype](
            q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), limits.ctypes.data, rows, kv_heads,
            heads // kv_heads, head_dim, keys.shape[2], head_dim ** -0.5, self._scores.data_ptr(), out.data_ptr())
        if status != 0:
            raise ValueError(f"attend refused shapes q {tuple(q.shape)}, keys {tuple(keys.shape)}")
        return out


def decode_attention(built: kernels.Kernels | None, group: int, head_dim: int,
                     positions: int) -> DecodeAttention | None:
    """The kernel for a model of these shapes; None where there is none or it cannot run them."""
    if built is None or group > MAX_GROUP or head_dim > MAX_DIM:
        return None
    return DecodeAttention(built, group, positions)
