"""``dtype: auto``: bfloat16 on a GPU; on a CPU, whichever of float32 and bfloat16 runs this CPU's
matrix products faster.

Whether bfloat16 pays on a CPU depends on the chip: with AVX512-BF16 or AMX its products run in
hardware and read half the bytes, without them they are emulated and slower than float32. The
choice is measured once per CPU model, feature set, torch version and thread count, and kept in
the model cache, so later starts read it (docs/performance.md, "Measured at a worker's first start").

The same goes for 4-bit weights (``Linear.pack_int4``): up to how many rows a product on them beats
the dense weights in the model's dtype depends on the chip (its memory bandwidth against its
arithmetic), so it is measured once as well (``int4_rows``), and so is whether a prompt chunk's dense
product should take a step's decoding rows along rather than leave them to a 4-bit pass of their own
(``merge_rows``).
"""

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import functional

from workers.model import cachelock
from workers.model.cpu import kernels
from workers.model.cpu.groups import Groups4
from workers.model.linear import PREFILL_ROWS, Linear, can_prepack

logger = logging.getLogger(__name__)

GAIN_NEEDED = 1.1  # bfloat16 must be clearly faster: float32 is the more exact of the two
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# a decoding step's kind of products: one and sixteen rows
_ROWS = (1, 16)
_SHAPE = (2048, 1024)
_LAYERS = 8
# 4-bit against dense products are timed with their weights read from memory, as a step's are (its
# layers' weights pass through the caches once a step): before each run, twice the last-level cache
# is read, up to this many bytes. Where the measure's layers stay in a large L3 between runs, dense
# products look faster than they are in a step
# (docs/performance.md, "Measured at a worker's first start"). Three rounds each, not more: the
# reads take time at a worker's first start
_MOST_EVICTED = 1 << 30
_LAST_LEVEL_CACHE = 32 << 20  # where the OS does not say
# no further, though kernels.c's AVX2 products beat float32 weights for many more rows: a longer
# prompt prefills on the dense weights and float inputs, as its inputs quantised to 8 bits moved
# greedy answers off the float32 model's (docs/performance.md, "Weights in 4-bit and 8-bit groups")
_INT4_ROWS = (1, 2, 4, 8, 16, 32)
# kernels.c's 4-bit products within this much of the dense ones' time still pay: a step whose rows
# all fit them runs its layers in one call (workers/model/cpu/layerstep.py), without the Python
# between a layer's parts. Where the products alone come that close, the measure may read either
# count from one start to the next, while whole steps run clearly faster on the 4-bit ones
# (docs/performance.md, "Measured at a worker's first start")
NATIVE_TIE = 1.1
MERGE_CHUNK = 32  # prompt tokens of the chunk that ``merge_rows`` is measured beside


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

    def measure() -> str:
        fp32, bf16 = _seconds(torch.float32), _seconds(torch.bfloat16)
        choice = "bfloat16" if bf16 * GAIN_NEEDED < fp32 else "float32"
        logger.info("CPU matrix products: float32 %.1f ms, bfloat16 %.1f ms: %s on %s", fp32 * 1e3, bf16 * 1e3,
                    choice, cpu_signature())
        return choice

    return torch.bfloat16 if _cached(cache_dir, cpu_signature(), measure) == "bfloat16" else torch.float32


def native_products(kernel_dir: Path) -> kernels.Kernels | None:
    """``kernels.c`` (built into ``kernel_dir``) where the decoder will run 4-bit products on it (they
    beat torch's kernel here), so that the rows measured are those of the products that will run."""
    built = kernels.load(kernel_dir)
    return built if built is not None and built.products_run_here() else None


def int4_rows(cache_dir: Path, dtype: torch.dtype, native: kernels.Kernels | None = None) -> int:
    """The most rows a product on 4-bit weights (through ``native`` where given, else torch's kernel)
    runs faster than on dense ``dtype`` weights laid out as the decoder lays them out (0: never;
    measured once per CPU, dtype and kind of product, then read from the cache)."""
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return 0

    def measure() -> str:
        other = _other_data()
        rows = _most_rows(_INT4_ROWS, lambda count: _product_seconds(dtype, count, native=native, other=other),
                          NATIVE_TIE if native is not None else 1.0)
        logger.info("4-bit weights pay for products of up to %d rows on %s", rows, cpu_signature())
        return str(rows)

    signature = f"{cpu_signature()} int4{_kernels(native)} from memory{_tie(native)} vs {_name(dtype)}"
    return int(_cached(cache_dir, signature, measure))


def merge_rows(cache_dir: Path, dtype: torch.dtype, packed_rows: int, native: kernels.Kernels | None = None) -> int:
    """The most decoding rows that a dense product of a prompt chunk (``Linear``) takes along
    for less than a 4-bit product of those rows alone costs (0: never; measured once per CPU and dtype
    for a chunk of ``MERGE_CHUNK`` rows, then read from the cache). Where the dense product is bound by
    reading the weights (bfloat16 on AMX), a few more rows are nearly free; where it is bound by its
    arithmetic (float32 on AVX2), the 4-bit pass is cheaper."""
    if not packed_rows:
        return 0

    def measure() -> str:
        counts = tuple(count for count in _INT4_ROWS if count <= packed_rows)
        other = _other_data()
        rows = _most_rows(counts, lambda count: _merge_seconds(dtype, count, native=native, other=other)[::-1])
        logger.info("a dense chunk product takes up to %d decoding rows along on %s", rows, cpu_signature())
        return str(rows)

    signature = f"{cpu_signature()} merge{_kernels(native)} from memory vs {_name(dtype)}"
    return min(packed_rows, int(_cached(cache_dir, signature, measure)))


def _most_rows(counts: tuple[int, ...], seconds: Callable[[int], tuple[float, float]], tie: float = 1.0) -> int:
    """The largest of the rising ``counts`` up to which the second way (``seconds(count)``: the first
    way's time, the second's) is the faster one, or within ``tie`` times the first's (0: not even at
    the first)."""
    rows = 0
    for count in counts:
        first, second = seconds(count)
        if second >= first * tie:
            break
        rows = count
    return rows


def _kernels(native: kernels.Kernels | None) -> str:
    """In the cache's key of figures measured on ``native``'s products: which layout they take."""
    if native is None:
        return ""
    layout = f"blocks of {native.product_block}, " if native.product_block else ""
    return f" (kernels.c, {layout}float16 scales)"  # float16 scales: a sixth fewer bytes than float32


def _tie(native: kernels.Kernels | None) -> str:
    """In the cache's key of ``int4_rows``: how close kernels.c's products may come and still pay."""
    return f", within {NATIVE_TIE}x" if native is not None else ""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cached(cache_dir: Path, signature: str, measure: Callable[[], str]) -> str:
    """What ``measure`` found for ``signature``, measured once and kept in ``precision.json``, by one
    process at a time (``cachelock``): measured at once, each would time the others' load."""
    path = cache_dir / "precision.json"
    known = _read(path)
    if signature not in known:
        with cachelock.held(cache_dir / "precision.lock"):
            known = _read(path)
            if signature not in known:
                known[signature] = measure()
                _write(path, known)
    return known[signature]


def _read(path: Path) -> dict[str, str]:
    try:
        known: dict[str, str] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known


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


def _layers(dtype: torch.dtype, packed_rows: int,
            native: kernels.Kernels | None) -> list[tuple[Linear, Linear]]:
    """``_LAYERS`` layers of ``_SHAPE``, each dense (prepacked where the decoder prepacks) and on 4-bit
    groups (for products of up to ``packed_rows`` rows; through ``native`` where given)."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(_LAYERS):
        dense = Linear(torch.randn(_SHAPE, generator=generator).to(dtype))
        if can_prepack(dtype):
            dense.prepack(PREFILL_ROWS)
        packed = Linear(dense.weight.detach())
        source = dense.weight.detach().float()
        packed.pack_int4(Groups4.of(source).for_torch() if native is None else native.int4_weights(source),
                         packed_rows)
        layers.append((dense, packed))
    return layers


def last_level_cache(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of the largest of the first CPU's ``caches`` (as Linux lists them; ``_LAST_LEVEL_CACHE``
    where it lists none)."""
    sizes, units = [], {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for path in caches.glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=_LAST_LEVEL_CACHE)


def _other_data() -> Tensor:
    """Data to read between timed runs, so that their weights come from memory: twice the last-level
    cache, at most ``_MOST_EVICTED`` bytes and a quarter of the memory free now (a worker's start must
    not fail for a measurement)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free = 4 * _MOST_EVICTED
    return torch.ones(max(min(2 * last_level_cache(), _MOST_EVICTED, free // 4), 4) // 4)


def _best_of(rounds: int, *runs: Callable[[], object], other: Tensor | None = None) -> list[float]:
    """Each run's least CPU time of ``rounds`` (the thread's own time: other processes do not count),
    each run's weights read from memory: ``other`` (``_other_data``) read before it."""
    best = [float("inf")] * len(runs)
    other = _other_data() if other is None else other
    with torch.inference_mode():
        for _ in range(rounds):
            for i, run in enumerate(runs):
                other.sum()
                started = time.thread_time()
                run()
                best[i] = min(best[i], time.thread_time() - started)
    return best


def _product_seconds(dtype: torch.dtype, rows: int, rounds: int = 3, native: kernels.Kernels | None = None,
                     other: Tensor | None = None) -> tuple[float, float]:
    """CPU time of ``rows``-row products through dense and 4-bit layers of the same shape."""
    layers = _layers(dtype, rows, native)
    x = torch.randn((rows, _SHAPE[1]), generator=torch.Generator().manual_seed(1)).to(dtype)
    dense, packed = _best_of(rounds, lambda: [layer[0](x) for layer in layers],
                             lambda: [layer[1](x) for layer in layers], other=other)
    return dense, packed


def _merge_seconds(dtype: torch.dtype, rows: int, rounds: int = 3, native: kernels.Kernels | None = None,
                   other: Tensor | None = None) -> tuple[float, float]:
    """CPU time of a ``MERGE_CHUNK``-row chunk's dense products with ``rows`` decoding rows along, and
    of the chunk's dense products beside the decoding rows' own 4-bit ones."""
    layers = _layers(dtype, rows, native)
    generator = torch.Generator().manual_seed(1)
    chunk = torch.randn((MERGE_CHUNK, _SHAPE[1]), generator=generator).to(dtype)
    decoding = torch.randn((rows, _SHAPE[1]), generator=generator).to(dtype)
    both = torch.cat((decoding, chunk))
    merged, apart = _best_of(rounds, lambda: [layer[0](both) for layer in layers],
                             lambda: [(layer[1](decoding), layer[0](chunk)) for layer in layers], other=other)
    return merged, apart


def _write(path: Path, known: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(known, indent=1))
    os.replace(staging, path)
