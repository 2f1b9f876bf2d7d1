"""CPU kernels of the decoding step (``kernels.c``), built on the host that runs them.

Three parts of a SmolLM2-sized decoding step cost far more through torch on a CPU than the bytes they
read: attention for one query row per sequence (``attention.DecodeAttention``), the output layer's
product on its 8-bit codes (``Kernels.int8_weights``; torch has no kernel for 8-bit groups, and
``Groups8.for_torch`` runs its 4-bit one twice instead) and the layers' products on 4-bit groups
(``Kernels.int4_weights``; torch's kernel takes bfloat16 inputs and converts every weight to
float). Both products quantise their inputs to 8 bits per 32, as llama.cpp does, and multiply the
codes as integers (AVX512-VNNI, else AVX2's byte products). Three more cost far more through torch
than their arithmetic: the RMS norm of the float32 residual (``Kernels.rms_norm``), the rotation of
queries and keys with the cache writes (``Kernels.rope_store``) and the MLP's activation
(``Kernels.silu_mul``). All are C on the calling thread, but for long decoding rows' attention, which
a helper thread shares where torch leaves it a core (``Kernels.configure_helper``). Where all of a
layer runs through them, a step's layers run in one call (``layers_*``: ``workers.model.cpu.layerstep``).

They are compiled with the system C compiler (``$CC``, else ``cc``) for this CPU (``-march=native``;
``-ffast-math`` for glibc's vectorised ``expf``), once per source, build recipe, compiler and CPU, into
``<model cache>/kernels``, and loaded with ``ctypes``. Without a compiler, or where the build fails,
the step runs on torch alone, as before (logged once).
"""

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from workers.model import cachelock
from workers.model.cpu.groups import GROUP, Groups4, in_blocks, scales_in_blocks

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# they run one thread: where torch runs more, its own parallel kernels are used
MAX_THREADS = {"attend": 2, "int8": 1}
# decoding rows at least this long share their attention with the helper thread (kernels.c, "The helper")
HELPER_MIN_LENGTH = 256
_helper_allowed = True  # allow_helper
MAX_TOP = 64  # as in kernels.c
# the first: vectorised expf from glibc's libmvec; the second for a libc without it
_FLAG_SETS = (["-O3", "-march=native", "-ffast-math"], ["-O3", "-march=native", "-fno-math-errno"])
_LIBS = (["-lmvec", "-lm", "-lpthread"], ["-lm", "-lpthread"])
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: dict[str, list[type]] = {
    "attend_bf16": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P, _P, _P],
    "attend_f16": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P, _P, _P],
    "attend_f32": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P, _P, _P],
    "f16_fast": [],
    "helper_configure": [_I],
    "int8_matmul": [_P, _I, _I, _P, _P, _I, _P],
    "int4_matmul": [_P, _I, _I, _P, _P, _P, _I, _P],
    "product_block": [],
    "int8_vectorised": [],
    "rms_norm_f32": [_P, _I, _I, _P, ctypes.c_float, _P],
    "silu_mul_f32": [_P, _I, _I, _P],
    "top_k_f32": [_P, _I, _I, _I, _P],
    "rope_store_bf16": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _P, _P],
    "rope_store_f16": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _P, _P],
    "rope_store_f32": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _P, _P],
    "layers_bf16": [_P, _I, _P, _I, _P, ctypes.c_float, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P],
    "layers_f16": [_P, _I, _P, _I, _P, ctypes.c_float, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P],
    "layers_f32": [_P, _I, _P, _I, _P, ctypes.c_float, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P],
}
_ROPE_STORE = {torch.bfloat16: "rope_store_bf16", torch.float16: "rope_store_f16", torch.float32: "rope_store_f32"}


class Kernels:
    """``kernels.c`` as loaded, its functions typed."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.functions = typed(library, _SIGNATURES)
        # built with AVX512-VNNI or AVX2 (this CPU has it): otherwise the products are plain C, slower than torch's
        self.int8_vectorised = bool(self.functions["int8_vectorised"]())
        # float16 converted by the CPU's own instructions (F16C): a float16 cache costs no more arithmetic
        self.f16_fast = bool(self.functions["f16_fast"]())
        # weight rows per block of the products' codes (kernels.c, "The blocks"): 8 on AVX2, 16 on
        # AVX512-VNNI, else 0
        self.product_block = int(self.functions["product_block"]())

    def configure_helper(self, min_length: int) -> bool:
        """Decoding rows at least ``min_length`` long attend with ``kernels.c``'s helper thread from now
        on, in this process (0: none do); whether it can run here."""
        return bool(self.functions["helper_configure"](min_length))

    def products_run_here(self) -> bool:
        """Whether the products beat torch's here: vectorised, and torch on one thread."""
        return self.int8_vectorised and runs_here("int8")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``torch.nn.functional.rms_norm`` of float32 rows ``x`` ``[rows, n]`` (contiguous) with float32
        ``weight`` ``[n]``: one call instead of torch's seven operators on a CPU."""
        rows, n = x.shape
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != (n,) \
                or not x.is_contiguous() or not weight.is_contiguous():
            raise ValueError(f"rms_norm_f32 does not take rows {tuple(x.shape)} ({x.dtype}), weight "
                             f"{tuple(weight.shape)} ({weight.dtype})")
        out = torch.empty_like(x)
        self.functions["rms_norm_f32"](x.data_ptr(), rows, n, weight.data_ptr(), eps, out.data_ptr())
        return out

    def silu_mul(self, x: Tensor) -> Tensor:
        """``silu(gate) * up`` of float32 rows ``x`` ``[rows, 2 n]`` (contiguous; gate the first half of
        a row), float32 ``[rows, n]``: one call instead of torch's cast, split and two operators."""
        rows, width = x.shape
        if x.dtype != torch.float32 or not x.is_contiguous() or width % 2:
            raise ValueError(f"silu_mul_f32 does not take rows {tuple(x.shape)} ({x.dtype})")
        out = torch.empty((rows, width // 2))
        self.functions["silu_mul_f32"](x.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def top_k(self, x: Tensor, k: int) -> Tensor:
        """Where the ``k`` largest of each float32 row of ``x`` ``[rows, n]`` (contiguous) are, int64
        ``[rows, k]`` in no order: ``x.topk(k, sorted=False).indices`` for rows without NaN, in one
        scan (AVX512 compares) instead of torch's selection."""
        rows, n = x.shape
        if x.dtype != torch.float32 or not x.is_contiguous() or not 1 <= k <= min(n, MAX_TOP):
            raise ValueError(f"top_k_f32 does not take the {k} largest of rows {tuple(x.shape)} ({x.dtype})")
        indices = torch.empty((rows, k), dtype=torch.int64)
        self.functions["top_k_f32"](x.data_ptr(), rows, n, k, indices.data_ptr())
        return indices

    def rope_store(self, qkv: Tensor, heads: int, tables: tuple[Tensor, Tensor], rows: tuple[np.ndarray, np.ndarray],
                   keys: Tensor, values: Tensor) -> Tensor:
        """The queries of a step's rows ``[N, heads, head_dim]`` in the cache's dtype, rotated, and
        their keys (rotated) and values written into ``keys``/``values`` ``[slots, kv_heads,
        positions, head_dim]`` at each row's slot and position (``rows``: positions, slots, int64):
        ``layers.rotate`` and the cache writes in one call. ``qkv`` float32 ``[N, (heads + 2 kv_heads)
        * head_dim]`` (the fused product), ``tables`` float32 cosines and signed sines ``[positions,
        head_dim]`` (``layers.rope_tables``)."""
        count, kv, slot_positions, d = keys.shape
        (cos, sin), (positions, slots) = tables, rows
        name = _ROPE_STORE.get(keys.dtype)
        if name is None or qkv.dtype != torch.float32 or not qkv.is_contiguous() or d % 2 \
                or qkv.shape[1:] != ((heads + 2 * kv) * d,) or values.shape != keys.shape \
                or values.dtype != keys.dtype or not keys.is_contiguous() or not values.is_contiguous() \
                or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != sin.shape \
                or cos.shape[1:] != (d,) or cos.shape[0] < slot_positions or not cos.is_contiguous() \
                or not sin.is_contiguous() or positions.shape != (qkv.shape[0],) or slots.shape != positions.shape \
                or positions.dtype != np.int64 or slots.dtype != np.int64:
            raise ValueError(f"rope_store does not take qkv {tuple(qkv.shape)} for keys {tuple(keys.shape)}")
        q = torch.empty((qkv.shape[0], heads, d), dtype=keys.dtype)
        if self.functions[name](qkv.data_ptr(), qkv.shape[0], heads, kv, d, cos.data_ptr(), sin.data_ptr(),
                                positions.ctypes.data, slots.ctypes.data, count, slot_positions, keys.data_ptr(),
                                values.data_ptr(), q.data_ptr()) != 0:
            raise ValueError(f"rope_store: a position or slot outside keys {tuple(keys.shape)}")
        return q

    def int8_weights(self, codes: Tensor, scales: Tensor) -> "GroupedWeights":
        """Weights ``codes * scales`` per group of 32 inputs (``codes`` ``[n, k]`` int8, ``scales`` ``[n, k /
        32]`` float32 holding float16's values, as Q8_0 holds them: ``Groups8``) for
        ``int8_matmul``, which reads the scales in float16."""
        n, k = codes.shape
        if k % GROUP or codes.dtype != torch.int8 or scales.shape != (n, k // GROUP) or scales.dtype != torch.float32 \
                or not torch.equal(scales.half().float(), scales):
            raise ValueError(f"8-bit groups of codes {tuple(codes.shape)}, scales {tuple(scales.shape)} "
                             f"({scales.dtype}, float16's values)")
        scales = scales.half()
        if self.product_block:  # [blocks, groups, step, row, 4]
            codes = in_blocks(codes.view(n, k // GROUP, GROUP), self.product_block, 4).flatten(1)
            scales = scales_in_blocks(scales, self.product_block)
        return GroupedWeights(self.functions["int8_matmul"], n, k, (codes, scales), bits=8)

    def int4_weights(self, weight: Tensor, groups: Groups4 | None = None) -> "GroupedWeights":
        """``weight`` (float32 ``[n, k]``; ``groups``: already quantised) in 4-bit groups
        (``Groups4.for_kernels_c``) for ``int4_matmul``."""
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"4-bit groups of {tuple(weight.shape)}: not a multiple of {GROUP} inputs")
        laid_out = (groups or Groups4.of(weight)).for_kernels_c(self.product_block)
        return GroupedWeights(self.functions["int4_matmul"], n, k, laid_out, bits=4)


class GroupedWeights:
    """Weights in 8-bit or 4-bit groups and the ``kernels.c`` product that takes them: ``x @ w.T`` in
    float32, ``x`` quantised to 8 bits per 32 inputs first (checked once here, so that a call costs
    little: a step makes four a layer)."""

    def __init__(self, function: Any, n: int, k: int, tensors: tuple[Tensor, ...], bits: int) -> None:
        self._function, self.n, self.k, self.bits = function, n, k, bits
        self._tensors = tuple(t.contiguous() for t in tensors)  # kept: the pointers point into them
        self.pointers = tuple(t.data_ptr() for t in self._tensors)  # codes, scales (and minimums: 4 bits)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors)

    @property
    def kind(self) -> str:
        return f"{self.bits}-bit groups"

    def __call__(self, x: Tensor) -> Tensor:
        x = float_rows(x, self.k)
        rows, k = x.shape
        out = torch.empty((rows, self.n))
        if self._function(x.data_ptr(), rows, k, *self.pointers, self.n, out.data_ptr()) != 0:
            raise MemoryError("kernels.c: no memory for the quantised inputs")
        return out


def typed(library: ctypes.CDLL, signatures: dict[str, list[type]]) -> dict[str, Any]:
    """A built library's functions by name, their arguments typed, each returning a C int."""
    functions = {}
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
        functions[name] = function
    return functions


def float_rows(x: Tensor, k: int) -> Tensor:
    """A product's inputs as the C products take them: contiguous float32 rows of ``k``."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    if x.shape[-1] != k:
        raise ValueError(f"inputs of {x.shape[-1]} for weights of {k}")
    return x


def allow_helper(allowed: bool) -> None:
    """Whether attention may take a second thread in this process (``LMSP_ATTENTION_HELPER``)."""
    global _helper_allowed
    _helper_allowed = allowed


def helper_fits() -> bool:
    """Whether the helper thread is allowed and torch's threads leave it a core of this process's."""
    return _helper_allowed and torch.get_num_threads() < len(os.sched_getaffinity(0))


def runs_here(kernel: str) -> bool:
    """Whether torch's thread count leaves ``kernel`` (``MAX_THREADS``) the faster choice."""
    return torch.get_num_threads() <= MAX_THREADS[kernel]


def load(directory: Path) -> Kernels | None:
    """The kernels, built (once) into ``directory``; None where they cannot be built or loaded."""
    path = compiled(SOURCE, directory)
    if path is None:
        return None
    try:
        return Kernels(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        logger.warning("kernels.c did not load (%s): the decoding step runs on torch alone", exc)
        return None


def compiled(source: Path, directory: Path) -> Path | None:
    """``source`` (a C file of this folder) built for this CPU into ``directory``, once per source,
    recipe, compiler and CPU; None where no compiler builds it (logged)."""
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("no C compiler (%s: %s): %s is not built, torch runs its part", compiler, exc, source.name)
        return None
    recipe = repr((_FLAG_SETS, _LIBS, "compiled, then linked")).encode()
    key = hashlib.sha256(source.read_bytes() + recipe + version + _cpu_flags().encode()).hexdigest()[:16]
    path = directory / f"{source.stem}-{key}.so"
    if path.exists():
        return path
    with cachelock.held(directory / f"{source.stem}.lock"):
        if not path.exists() and not _build(compiler, source, directory, path):
            return None
    return path


def _build(compiler: str, source: Path, directory: Path, path: Path) -> bool:
    """Compile into files of its own, then move the library in place: a process that finds it without
    the lock never loads half a library. Compiled and linked in two steps: linked with ``-ffast-math``,
    gcc adds start-up code that flushes subnormal floats to zero for the whole thread that loads it."""
    errors = []
    for flags, libraries in zip(_FLAG_SETS, _LIBS, strict=True):
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            objects, library = Path(scratch) / f"{source.stem}.o", Path(scratch) / f"{source.stem}.so"
            failure = _run([compiler, *flags, "-fPIC", "-c", "-o", str(objects), str(source)]) \
                or _run([compiler, "-shared", "-o", str(library), str(objects), *libraries])
            if failure is None:
                os.replace(library, path)
                logger.info("built %s for this CPU: %s", source.name, path.name)
                return True
        errors.append(failure)
    logger.warning("%s did not build (%s): torch runs its part", source.name, " | ".join(errors))
    return False


def _run(command: list[str]) -> str | None:
    """Run a compiler command; None if it succeeded, else the end of what it said."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr.strip()[-500:]


def _cpu_flags() -> str:
    """What ``-march=native`` depends on: the CPU's model and every feature flag."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(wanted[:2]) + os.uname().machine
