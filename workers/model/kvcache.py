"""KV slots: the keys and values of a worker's model, a whole context window for each running sequence.

The cache is allocated once per worker and model; joining and leaving never copy, concatenate or
allocate it (a new sequence may start from a prefix another slot holds, ``workers.engine.prefixes``:
that is copied once, in place of computing it).
"""

import numpy as np
import torch
from numpy._core import multiarray
from torch import Tensor, nn


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros whose memory, on a CPU, is committed only where written (calloc'ed pages): a slot
    array sized for the whole context window costs what the sequences use."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # numpy asks for huge pages on large arrays, which would commit 2 MiB at the first write
    huge = multiarray._set_madvise_hugepage(False)  # type: ignore[attr-defined]
    try:
        raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    finally:
        multiarray._set_madvise_hugepage(huge)  # type: ignore[attr-defined]
    return torch.from_numpy(raw).view(dtype)


class KvSlots(nn.Module):
    """Keys and values of every layer, ``[slots, kv_heads, positions, head_dim]`` each."""

    def __init__(self, layers: int, slots: int, kv_heads: int, positions: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (slots, kv_heads, positions, head_dim)
        self.slots, self.positions = slots, positions
        for i in range(layers):
            self.register_buffer(f"k{i}", lazy_zeros(shape, dtype, device), persistent=False)
            self.register_buffer(f"v{i}", lazy_zeros(shape, dtype, device), persistent=False)
        # one position of one slot, keys and values of every layer
        self.position_bytes = 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        for buffer in self.buffers():
            buffer[target, :, :length] = buffer[source, :, :length]
