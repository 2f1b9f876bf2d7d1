"""Products on a GGUF file's own blocks (``blocks.c``): the weights stay as the file holds them.

A model from a K-quant or Q8_0 GGUF (``workers.model.gguf``) runs every product on its tensors as
mapped from the file: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16 and F32 rows. The inputs are
quantised to 8 bits per block first, as llama.cpp does, and the products run on integers (AVX2's
byte products where built with them, else plain C). A product's weight rows are split between the
worker's threads (``Blocks.use_threads``), decoding and prompt rows alike.

Built with the system C compiler for this CPU, as ``kernels.c`` is (``kernels.compiled``).
"""

import ctypes
import logging
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from workers.model.cpu import kernels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("blocks.c")
# GGML's type numbers of what the products take, and each type's bytes per block of its weights
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
# not GGML's: Q4_K and Q6_K with each eight rows interleaved (``blocks.c``, block_q4_K_x8 and block_q6_K_x8),
# what a product makes of them
Q4_K_X8, Q6_K_X8 = 1012, 1014
INTERLEAVED = {Q4_K: Q4_K_X8, Q6_K: Q6_K_X8}
# not GGML's either: F16 and BF16 rows as the file holds them, each product taking four side by side
F16_X4, BF16_X4 = 1001, 1030
FOURS = {F16: F16_X4, BF16: BF16_X4}
FLOATS = (F32, F16, BF16, F16_X4, BF16_X4)
BLOCK_BYTES = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), F16_X4: (1, 2), BF16_X4: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20),
               Q5_0: (32, 22), Q5_1: (32, 24),
               Q8_0: (32, 34),
               Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), Q4_K_X8: (256, 148), Q6_K_X8: (256, 210)}
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", F16_X4: "F16", BF16_X4: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1",
              Q5_0: "Q5_0", Q5_1: "Q5_1",
              Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", Q4_K_X8: "Q4_K", Q6_K_X8: "Q6_K"}
# a prompt's products of at least TILE_ROWS rows on float weights run on float32 tiles of TILE weight
# rows; quantised weights' stay on their blocks, faster than de-quantised tiles through the matrix
# library (docs/performance.md, "GGUF weights in their own blocks")
TILE_ROWS, TILE = 64, 256
ALL_ROWS = 1 << 30  # products on a GGUF file's blocks take every step's rows
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: dict[str, list[type]] = {
    "blocks_matmul": [_P, _I, _I, _P, _I, _P],
    "blocks_rows": [_P, _I, _I, _I, _P, _I, _P],
    "blocks_quantize": [_P, _I, _I, _I, _P],
    "blocks_interleave": [_P, _I, _I, _I, _P],
    "blocks_threads": [ctypes.c_int],
    "blocks_plain": [ctypes.c_int],
    "blocks_vectorised": [],
}


@dataclass(frozen=True)
class BlockTensor:
    """A weight ``[rows, cols]`` in a GGML ``type``: ``data`` its bytes, one row of blocks per row
    (uint8 ``[rows, row bytes]``, a view of the mapped file or an array of its own)."""

    data: np.ndarray
    type: int
    rows: int
    cols: int

    def __post_init__(self) -> None:
        if self.type not in BLOCK_BYTES:
            raise ValueError(f"GGML type {self.type}: no product takes it")
        block, size = BLOCK_BYTES[self.type]
        shape = (self.rows, self.cols // block * size)
        if self.cols % block or self.data.dtype != np.uint8 or self.data.shape != shape \
                or not self.data.flags.c_contiguous or (self.type in INTERLEAVED.values() and self.rows % 8) \
                or (self.type in FOURS.values() and self.rows % 4):
            raise ValueError(f"a tensor of type {self.type}, {self.rows} x {self.cols}: bytes {self.data.shape}")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def pointer(self) -> int:
        return int(self.data.ctypes.data)


class _Part(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64)]


class Blocks:
    """``blocks.c`` as loaded, its functions typed."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.functions = kernels.typed(library, _SIGNATURES)
        self.vectorised = bool(self.functions["blocks_vectorised"]())
        self.threads = 1

    def use_threads(self, threads: int) -> int:
        """Split each product's weight rows between ``threads`` threads (the caller's one of them);
        returns how many there are. A prompt's products take as many of torch's."""
        self.threads = int(self.functions["blocks_threads"](threads))
        return self.threads

    def plain(self, on: bool) -> None:
        """Run the plain C products even where vectorised ones are built (the tests compare them)."""
        self.functions["blocks_plain"](int(on))

    def product(self, parts: Sequence[BlockTensor]) -> "BlockProduct":
        """One product over ``parts`` (their rows side by side in the output: a fused q, k and v), each
        arranged for its products first (``arranged``)."""
        starts = np.cumsum([0, *(part.rows for part in parts[:-1])])
        return BlockProduct(self, [self.arranged(part, int(start)) for part, start in zip(parts, starts, strict=True)])

    def arranged(self, tensor: BlockTensor, start: int) -> BlockTensor:
        """``tensor`` as its products read it fastest, where its rows and its first output column
        (``start``) are multiples of the group: Q4_K and Q6_K interleaved by eights (``interleaved``), F16
        and BF16 rows taken four at a time, in place (docs/performance.md, "GGUF weights in their own
        blocks")."""
        fours = FOURS.get(tensor.type)
        if fours is not None and tensor.rows % 4 == 0 and start % 4 == 0:
            return BlockTensor(tensor.data, fours, tensor.rows, tensor.cols)
        return self.interleaved(tensor) if start % 8 == 0 else tensor

    def interleaved(self, tensor: BlockTensor) -> BlockTensor:
        """A Q4_K or Q6_K tensor (rows a multiple of 8) with each eight rows interleaved, in memory of its
        own: its products read eight rows' codes for the same inputs in one load and scale eight rows at
        once, as llama.cpp repacks Q4_K (docs/performance.md, "GGUF weights in their own blocks"). The
        mapped file's pages it was read from are given back. Other tensors as they are."""
        kind = INTERLEAVED.get(tensor.type)
        if kind is None or tensor.rows % 8:
            return tensor
        block, size = BLOCK_BYTES[kind]
        data = np.empty((tensor.rows, tensor.cols // block * size), dtype=np.uint8)
        if self.functions["blocks_interleave"](tensor.pointer(), tensor.type, tensor.rows, tensor.cols,
                                               data.ctypes.data) != 0:
            raise ValueError(f"{TYPE_NAMES[tensor.type]} rows of {tensor.cols} do not interleave")
        _give_back(tensor.data)
        return BlockTensor(data, kind, tensor.rows, tensor.cols)

    def rows(self, tensor: BlockTensor, ids: Tensor) -> Tensor:
        """Rows ``ids`` (int64) of ``tensor`` in float32 ``[len(ids), cols]``: a step's embeddings."""
        flat = np.ascontiguousarray(ids.cpu().numpy(), dtype=np.int64).reshape(-1)
        out = torch.empty((flat.shape[0], tensor.cols))
        if self.functions["blocks_rows"](tensor.pointer(), tensor.type, tensor.cols, tensor.rows, flat.ctypes.data,
                                         flat.shape[0], out.data_ptr()) != 0:
            raise ValueError(f"rows outside a tensor of {tensor.rows}")
        return out.view(*ids.shape, tensor.cols)

    def quantized(self, x: Tensor, type_: int) -> Tensor:
        """The float32 rows ``x`` as the products on ``type_`` weights see them (codes times scales)."""
        x = x.float().contiguous()
        out = torch.empty_like(x)
        if self.functions["blocks_quantize"](x.data_ptr(), x.shape[0], x.shape[1], type_, out.data_ptr()) != 0:
            raise ValueError(f"inputs of {x.shape[1]} for type {type_}")
        return out


class BlockProduct:
    """``x @ w.T`` in float32 for weights in GGUF blocks (``Linear``'s ``NativeProduct``): on the blocks,
    the inputs quantised where the weights are; a prompt's many rows on float16 or bfloat16 weights on
    float32 tiles of them, converted a tile at a time, through torch's matrix product (``_tiled``)."""

    def __init__(self, built: Blocks, parts: Sequence[BlockTensor]) -> None:
        if not parts or len({part.cols for part in parts}) != 1:
            raise ValueError("a product's parts must share their inputs")
        self._built = built
        self._function = built.functions["blocks_matmul"]
        self._floats = all(part.type in FLOATS for part in parts)
        self._tensors = tuple(parts)  # kept: the table points into them
        self._table = (_Part * len(parts))(*(_Part(part.pointer(), part.type, part.rows) for part in parts))
        self.k = parts[0].cols
        self.n = sum(part.rows for part in parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self._tensors)

    @property
    def types(self) -> tuple[int, ...]:
        return tuple(part.type for part in self._tensors)

    @property
    def kind(self) -> str:
        return f"GGUF blocks ({', '.join(sorted({TYPE_NAMES[t] for t in self.types}))})"

    @property
    def rows_on_blocks(self) -> int:
        """The most rows a product runs on the blocks themselves (more float rows go through ``_tiled``)."""
        return TILE_ROWS - 1 if self._floats else ALL_ROWS

    @property
    def call(self) -> tuple[int, int, int]:
        """What ``kernels.c``'s one-call layers take to run this product (``layerstep``): the address of
        ``blocks_matmul``, of this product's table of parts, and how many parts it holds."""
        address = ctypes.cast(self._function, ctypes.c_void_p).value
        assert address is not None
        return address, ctypes.addressof(self._table), len(self._tensors)

    def __call__(self, x: Tensor) -> Tensor:
        x = kernels.float_rows(x, self.k)
        rows, k = x.shape
        if self._floats and rows >= TILE_ROWS:
            return self._tiled(x)
        out = torch.empty((rows, self.n))
        status = self._function(x.data_ptr(), rows, k, self._table, len(self._tensors), out.data_ptr())
        if status == -2:
            raise MemoryError("blocks.c: no memory for the quantised inputs")
        if status != 0:
            raise ValueError(f"blocks.c does not take types {self.types} with inputs of {k}")
        return out


    def _tiled(self, x: Tensor) -> Tensor:
        """The product of many rows: each tile of ``TILE`` weight rows de-quantised to float32 (in the
        caches) and multiplied by every input row at the matrix library's speed, on the products'
        threads (docs/performance.md, "GGUF weights in their own blocks")."""
        out = torch.empty((x.shape[0], self.n))
        threads = torch.get_num_threads()
        torch.set_num_threads(self._built.threads)
        try:
            start = 0
            for part in self._tensors:
                for first in range(0, part.rows, TILE):
                    ids = torch.arange(first, min(first + TILE, part.rows))
                    torch.matmul(x, self._built.rows(part, ids).T, out=out[:, start + first:start + first + len(ids)])
                start += part.rows
        finally:
            torch.set_num_threads(threads)
        return out


def _give_back(data: np.ndarray) -> None:
    """Drop the pages of a file mapping under ``data`` (a view of an ``np.memmap``) from this process: read
    again, they come back from the file. Memory of its own (a copy) is left alone: dropped, it would read
    as zeros."""
    base: object = data
    while isinstance(base, np.ndarray) and not isinstance(base.base, mmap.mmap):  # views of views
        base = base.base
    if not isinstance(base, np.memmap) or not isinstance(base.base, mmap.mmap):
        return
    mapping = base.base
    start_address = base.ctypes.data - base.offset % mmap.ALLOCATIONGRANULARITY
    offset = data.ctypes.data - start_address
    first = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (offset + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


def load(directory: Path) -> Blocks | None:
    """The products, built (once) into ``directory``; None where they cannot be built or loaded."""
    path = kernels.compiled(SOURCE, directory)
    if path is None:
        return None
    try:
        return Blocks(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        logger.warning("blocks.c did not load (%s)", exc)
        return None
