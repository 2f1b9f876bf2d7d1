"""``dtype: auto``: bfloat16 on a GPU; on a CPU, whichever of float32 and bfloat16 runs this CPU's
matrix products faster.

Whether bfloat16 pays on a CPU depends on the chip: with AVX512-BF16 or AMX its products run in
hardware and read half the bytes, without them they are emulated and slower than float32. The
choice is measured once per CPU model, feature set, torch version and thread count (a second),
and kept in the model cache, so later starts read it.

The same goes for 4-bit weights (``weights.pack_int4``): up to how many rows a product on them beats
the dense weights in the model's dtype depends on the chip (its memory bandwidth against its
arithmetic), so it is measured once as well (``int4_rows``).
"""

import json
import logging
import os
import time
from pathlib import Path

import torch
from torch.nn import functional

from workers import weights
from workers.decoder import PREFILL_ROWS

logger = logging.getLogger(__name__)

GAIN_NEEDED = 1.1  # bfloat16 must be clearly faster: float32 is the more exact of the two
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# a decoding step's kind of products: one and sixteen rows through layers larger than the caches
_ROWS = (1, 16)
_SHAPE = (2048, 1024)
_LAYERS = 8
_INT4_ROWS = (1, 2, 4, 8, 16, 32)


def cpu_signature() -> str:
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    features = ",".join(flag for flag in _FLAGS if flag in flags)
    return f"{name} [{features}] torch {torch.__version__} threads {torch.get_num_threads()}"


def cpu_dtype(cache_dir: Path) -> torch.dtype:
    """The faster of float32 and bfloat16 on this CPU (measured once, then read from the cache)."""
    path = cache_dir / "precision.json"
    signature = cpu_signature()
    try:
        known: dict[str, str] = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if signature not in known:
        fp32, bf16 = _seconds(torch.float32), _seconds(torch.bfloat16)
        known[signature] = "bfloat16" if bf16 * GAIN_NEEDED < fp32 else "float32"
        logger.info("CPU matrix products: float32 %.1f ms, bfloat16 %.1f ms: %s on %s", fp32 * 1e3, bf16 * 1e3,
                    known[signature], signature)
        _write(path, known)
    return torch.bfloat16 if known[signature] == "bfloat16" else torch.float32


def int4_rows(cache_dir: Path, dtype: torch.dtype) -> int:
    """The most rows a product on 4-bit weights runs faster than on dense ``dtype`` weights laid out as
    the decoder lays them out (0: never; measured once per CPU and dtype, then read from the cache)."""
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return 0
    path = cache_dir / "precision.json"
    signature = f"{cpu_signature()} int4 vs {str(dtype).removeprefix('torch.')}"
    try:
        known: dict[str, str] = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if signature not in known:
        rows = 0
        for count in _INT4_ROWS:
            dense, packed = _product_seconds(dtype, count)
            if packed >= dense:
                break
            rows = count
        known[signature] = str(rows)
        logger.info("4-bit weights pay for products of up to %d rows on %s", rows, signature)
        _write(path, known)
    return int(known[signature])


def _seconds(dtype: torch.dtype, rounds: int = 5) -> float:
    """CPU time of the products (the thread's own time: other processes on the machine do not count)."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(_SHAPE, generator=generator).to(dtype) for _ in range(_LAYERS)]
    best = float("inf")
    with torch.inference_mode():
        for rows in _ROWS:
            x = torch.randn((rows, _SHAPE[1]), generator=generator).to(dtype)
            for weight in weights[:2]:
                functional.linear(x, weight)
        for _ in range(rounds):
            started = time.thread_time()
            for rows in _ROWS:
                x = torch.randn((rows, _SHAPE[1]), generator=generator).to(dtype)
                for weight in weights:
                    functional.linear(x, weight)
            best = min(best, time.thread_time() - started)
    return best


def _product_seconds(dtype: torch.dtype, rows: int, rounds: int = 5) -> tuple[float, float]:
    """CPU time of ``rows``-row products through dense (prepacked where the decoder prepacks) and
    4-bit layers of the same shape."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(_LAYERS):
        dense = weights.Linear(torch.randn(_SHAPE, generator=generator).to(dtype))
        if weights.can_prepack(dtype):
            dense.prepack(PREFILL_ROWS)
        packed = weights.Linear(dense.weight.detach())
        packed.pack_int4(dense.weight.detach().float(), rows)
        layers.append((dense, packed))
    x = torch.randn((rows, _SHAPE[1]), generator=generator).to(dtype)
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(rounds):
            for kind in (0, 1):
                started = time.thread_time()
                for layer in layers:
                    layer[kind](x)
                best[kind] = min(best[kind], time.thread_time() - started)
    return best[0], best[1]


def _write(path: Path, known: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(known, indent=1))
    os.replace(staging, path)
