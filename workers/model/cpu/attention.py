"""A step's attention on a CPU, through ``kernels.c`` (``attend_*``): every decoding row and every
prompt chunk's rows, in one call per layer.

For few query rows per sequence, torch's ``scaled_dot_product_attention`` on a CPU costs several times
what reading the keys and values does, and it was most of what made a long generation's last tokens
slower than its first (docs/performance.md, "CPU kernels"). The kernel runs each decoding row
against its own slot up to its own last position (no mask), the queries of one key head's group
sharing every key and value as it is read, in float32 arithmetic whatever the cache's dtype (float32,
bfloat16, or float16: ``workers.model.build.cache_dtype``); without AVX512, 8 keys' scores are
summed at once (``kernels.c``, "The heads on AVX2"). A chunk's rows (consecutive rows of one slot)
attend as blocks of up to 16 rows whose queries share each key and value, with the arithmetic
blocked for AVX512 (``kernels.c``, "Blocks"): faster than torch's attention for chunks of every
size, so every chunk goes through the kernel, beside decoding or alone. It runs where torch runs on
at most two threads (``kernels.MAX_THREADS``; the default on a 2-core host is one); with more,
torch's attention runs the heads in parallel. Where torch's threads leave a core
(``kernels.helper_fits``), the key heads of decoding rows of ``kernels.HELPER_MIN_LENGTH`` positions
or more are shared with a helper thread of ``kernels.c``, which reads the next layer's keys and
values ahead while the model's thread runs the layer's products: a long row's attention waits on
memory, and two threads read it faster than one (the results bit for bit the same;
docs/performance.md, "CPU kernels"). A step's rows are checked once for all its layers
(``StepRows``).
"""

from typing import Any

import numpy as np
import torch
from torch import Tensor

from workers.model.cpu import kernels

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
        return self.rows(slots, limits)(q, keys, values, following)

    def rows(self, slots: np.ndarray, limits: np.ndarray) -> "StepRows":
        """A step's rows (``__call__``), checked once for all its layers."""
        return StepRows(self, slots, limits)


class StepRows:
    """The rows of one step, attending at each of its layers: what every layer shares is checked and
    converted once (checked at every layer, they cost a noticeable part of a step;
    docs/performance.md, "CPU kernels")."""

    def __init__(self, attention: DecodeAttention, slots: np.ndarray, limits: np.ndarray) -> None:
        self._attention = attention
        self.slots = np.ascontiguousarray(slots, dtype=np.int64)
        self.limits = np.ascontiguousarray(limits, dtype=np.int64)
        self.count = len(self.slots)
        if self.slots.shape != (self.count,) or self.limits.shape != (self.count,):
            raise ValueError(f"attend does not take slots {self.slots.shape} with limits {self.limits.shape}")
        self._slot_range = (int(self.slots.min()), int(self.slots.max())) if self.count else (0, -1)
        self.pointers = (self.slots.ctypes.data, self.limits.ctypes.data)  # the arrays are kept alive above
        self._checked: tuple[Any, ...] | None = None  # the shapes and dtype ``takes`` last took

    @property
    def scratch(self) -> Tensor:
        """The kernel's float32 scores, ``group * positions`` of them (one call at a time)."""
        return self._attention._scores

    def within(self, slots: int) -> bool:
        """Whether every row's slot is one of ``slots``."""
        low, high = self._slot_range
        return low >= 0 and high < slots

    def takes(self, q: Tensor, keys: Tensor) -> bool:
        """Whether these rows' queries and this layer's keys go through the kernel (``supports``), checked
        again only where a layer's shapes differ from the last one's."""
        shape = (q.shape, q.stride(), q.dtype, keys.shape, keys.dtype)
        if shape == self._checked:
            return True
        if not self._attention.supports(q, keys) or q.shape[0] != self.count or not self.within(keys.shape[0]):
            return False
        self._checked = shape
        return True

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor,
                 following: tuple[Tensor, Tensor] | None = None) -> Tensor:
        rows, heads, head_dim = q.shape
        if not self.takes(q, keys) or not (keys.is_contiguous() and values.is_contiguous()
                                           and values.shape == keys.shape and values.dtype == keys.dtype) \
                or (following is not None and not all(t.shape == keys.shape and t.dtype == keys.dtype
                                                      and t.is_contiguous() for t in following)):
            raise ValueError(f"attend does not take queries {tuple(q.shape)}, keys {tuple(keys.shape)}")
        attention = self._attention
        out = torch.empty((rows, heads * head_dim), dtype=q.dtype)
        ahead = (None, None) if following is None else (following[0].data_ptr(), following[1].data_ptr())
        status = attention._functions[q.dtype](
            q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), *self.pointers, rows, keys.shape[1],
            attention.group, head_dim, keys.shape[2],
            head_dim ** -0.5, attention._scores.data_ptr(), out.data_ptr(), *ahead)
        if status == -2:
            raise MemoryError("kernels.c: no memory for a block of chunk rows")
        if status != 0:
            raise ValueError(f"attend refused limits {self.limits.min()}..{self.limits.max()} for keys "
                             f"{tuple(keys.shape)}")
        return out


def decode_attention(built: kernels.Kernels | None, group: int, head_dim: int,
                     positions: int) -> DecodeAttention | None:
    """The kernel for a model of these shapes; None where there is none or it cannot run them."""
    if built is None or group > MAX_GROUP or head_dim > MAX_DIM:
        return None
    return DecodeAttention(built, group, positions)
