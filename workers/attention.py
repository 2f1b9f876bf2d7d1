"""Decoding rows' attention on a CPU: a small C kernel (``attend.c``), built on the host that runs it.

For one query row per sequence, torch's ``scaled_dot_product_attention`` on a CPU costs about three
times what reading the keys and values does (SmolLM2, bfloat16, one thread, on an AVX512-BF16 EPYC:
27 us a layer at 64 positions, 326 at 1,500; the kernel 9 and 106), and it is most of what makes a long
generation's last tokens slower than its first. The kernel reads each key and value once for all
queries of its key head, up to the row's own last position (no mask), in float32 arithmetic.

It is compiled with the system C compiler (``$CC``, else ``cc``) for this CPU (``-march=native``),
once per source, compiler and CPU, into ``<model cache>/kernels``, and loaded with ``ctypes``. Without
a compiler, or where the build fails, decoding rows attend through torch as before (logged once).
It is single-threaded, so it runs where torch runs on at most two threads (``MAX_THREADS``; the
default on a 2-core host is one); with more, torch's attention runs the heads in parallel.
"""

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attend.c")
MAX_THREADS = 2
MAX_GROUP, MAX_DIM = 16, 256  # as in attend.c
# the first: vectorised expf from glibc's libmvec; the second for a libc without it
_FLAG_SETS = (["-O3", "-march=native", "-ffast-math"], ["-O3", "-march=native", "-fno-math-errno"])
_LIBS = (["-lmvec", "-lm"], ["-lm"])
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P = ctypes.c_void_p
_I = ctypes.c_int64


class DecodeAttention:
    """``attend.c`` for one model's shapes: ``__call__`` attends the first ``rows`` rows of queries."""

    def __init__(self, library: ctypes.CDLL, group: int, positions: int) -> None:
        self.group, self.positions = group, positions
        self._scores = torch.empty(group * positions, dtype=torch.float32)  # one call at a time
        self._functions = {}
        for dtype, suffix in _DTYPES.items():
            function = getattr(library, f"attend_{suffix}")
            function.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P]
            function.restype = ctypes.c_int
            self._functions[dtype] = function

    def supports(self, q: Tensor, keys: Tensor) -> bool:
        """Whether ``__call__`` takes these queries and keys (its scratch holds ``positions`` per query)."""
        return q.dtype == keys.dtype and q.dtype in self._functions and keys.is_contiguous() \
            and q.shape[1] == self.group * keys.shape[1] and keys.shape[2] <= self.positions \
            and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and torch.get_num_threads() <= MAX_THREADS

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, limits: np.ndarray) -> Tensor:
        """``q`` ``[rows, heads, head_dim]`` (row ``r``: slot ``r``), ``keys``/``values`` ``[slots, kv_heads,
        positions, head_dim]`` (contiguous), ``limits``: the last position each row attends to (int64).
        Returns ``[rows, heads * head_dim]``."""
        if not self.supports(q, keys) or values.shape != keys.shape or not values.is_contiguous():
            raise ValueError(f"attend.c does not take queries {tuple(q.shape)}, keys {tuple(keys.shape)}")
        rows, heads, head_dim = q.shape
        kv_heads = keys.shape[1]
        out = torch.empty((rows, heads * head_dim), dtype=q.dtype)
        limits = np.ascontiguousarray(limits, dtype=np.int64)
        status = self._functions[q.dtype](
            q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), limits.ctypes.data, rows, kv_heads,
            heads // kv_heads, head_dim, keys.shape[2], head_dim ** -0.5, self._scores.data_ptr(), out.data_ptr())
        if status != 0:
            raise ValueError(f"attend.c refused shapes q {tuple(q.shape)}, keys {tuple(keys.shape)}")
        return out


def load(directory: Path, group: int, head_dim: int, positions: int) -> DecodeAttention | None:
    """The kernel for a model of these shapes, built (once) into ``directory``; None where it cannot
    run them or cannot be built."""
    if group > MAX_GROUP or head_dim > MAX_DIM:
        return None
    library = _library(directory)
    return None if library is None else DecodeAttention(library, group, positions)


def _library(directory: Path) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("no C compiler (%s: %s): decoding rows attend through torch", compiler, exc)
        return None
    key = hashlib.sha256(source + version + _cpu_flags().encode()).hexdigest()[:16]
    path = directory / f"attend-{key}.so"
    if not path.exists() and not _build(compiler, directory, path):
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("attend.c did not load (%s): decoding rows attend through torch", exc)
        return None


def _build(compiler: str, directory: Path, path: Path) -> bool:
    """Compile into a file of its own, then move it in place: workers starting at once each build."""
    directory.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags, libraries in zip(_FLAG_SETS, _LIBS, strict=True):
        fd, temporary = tempfile.mkstemp(dir=directory, suffix=".so")
        os.close(fd)
        command = [compiler, *flags, "-fPIC", "-shared", "-o", temporary, str(SOURCE), *libraries]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            done = subprocess.CompletedProcess(command, 1, "", str(exc))
        if done.returncode == 0:
            os.replace(temporary, path)
            logger.info("built attend.c for this CPU: %s", path.name)
            return True
        os.unlink(temporary)
        errors.append(done.stderr.strip()[-500:])
    logger.warning("attend.c did not build (%s): decoding rows attend through torch", " | ".join(errors))
    return False


def _cpu_flags() -> str:
    """What ``-march=native`` depends on: the CPU's model and every feature flag."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(wanted[:2]) + os.uname().machine
