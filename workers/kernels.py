"""CPU kernels of the decoding step (``kernels.c``), built on the host that runs them.

Two parts of a SmolLM2-sized decoding step cost far more through torch on a CPU than the bytes they
read: attention for one query row per sequence (``attention.DecodeAttention``) and the output layer's
product on its 8-bit codes (``Kernels.int8_product``; torch has no kernel for 8-bit groups, and
``weights.int8_groups`` runs its 4-bit one twice instead). Both are single-threaded C.

They are compiled with the system C compiler (``$CC``, else ``cc``) for this CPU (``-march=native``;
``-ffast-math`` for glibc's vectorised ``expf``), once per source, compiler and CPU, into
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

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# they run one thread: where torch runs more, its own parallel kernels are used
MAX_THREADS = {"attend": 2, "int8": 1}
GROUP = 32  # inputs per scale of 8-bit groups (as in kernels.c and GGUF's Q8_0)
# the first: vectorised expf from glibc's libmvec; the second for a libc without it
_FLAG_SETS = (["-O3", "-march=native", "-ffast-math"], ["-O3", "-march=native", "-fno-math-errno"])
_LIBS = (["-lmvec", "-lm"], ["-lm"])
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: dict[str, list[type]] = {
    "attend_bf16": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P],
    "attend_f32": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P],
    "int8_quantize": [_P, _I, _I, _P, _P, _P],
    "int8_product": [_P, _P, _P, _I, _P, _P, _I, _I, _P],
    "int8_vectorised": [],
}


class Kernels:
    """``kernels.c`` as loaded, its functions typed."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.functions = {}
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = None if name in ("int8_quantize", "int8_product") else ctypes.c_int
            self.functions[name] = function
        # built with AVX512-VNNI (this CPU has it): otherwise the 8-bit product is plain C, slower than torch's
        self.int8_vectorised = bool(self.functions["int8_vectorised"]())

    def int8_product(self, x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
        """``x @ w.T`` (float32) for ``w = codes * scales`` per group of 32 inputs (``codes`` ``[n, k]``
        int8, ``scales`` ``[n, k / 32]`` float32, both contiguous), ``x`` ``[rows, k]`` quantised to 8 bits
        per 32 first."""
        x = x.float().contiguous()
        rows, k = x.shape
        n = codes.shape[0]
        if k % GROUP or codes.shape != (n, k) or scales.shape != (n, k // GROUP) or codes.dtype != torch.int8 \
                or scales.dtype != torch.float32 or not (codes.is_contiguous() and scales.is_contiguous()):
            raise ValueError(f"int8_product does not take x {tuple(x.shape)}, codes {tuple(codes.shape)}")
        quantized = torch.empty((rows, k), dtype=torch.int8)
        scale, correction = torch.empty((rows, k // GROUP)), torch.empty((rows, k // GROUP))
        out = torch.empty((rows, n))
        self.functions["int8_quantize"](x.data_ptr(), rows, k, quantized.data_ptr(), scale.data_ptr(),
                                        correction.data_ptr())
        self.functions["int8_product"](quantized.data_ptr(), scale.data_ptr(), correction.data_ptr(), rows,
                                       codes.data_ptr(), scales.data_ptr(), n, k, out.data_ptr())
        return out


def runs_here(kernel: str) -> bool:
    """Whether torch's thread count leaves ``kernel`` (``MAX_THREADS``) the faster choice."""
    return torch.get_num_threads() <= MAX_THREADS[kernel]


def load(directory: Path) -> Kernels | None:
    """The kernels, built (once) into ``directory``; None where they cannot be built or loaded."""
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("no C compiler (%s: %s): the decoding step runs on torch alone", compiler, exc)
        return None
    key = hashlib.sha256(source + version + _cpu_flags().encode()).hexdigest()[:16]
    path = directory / f"kernels-{key}.so"
    if not path.exists() and not _build(compiler, directory, path):
        return None
    try:
        return Kernels(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        logger.warning("kernels.c did not load (%s): the decoding step runs on torch alone", exc)
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
            logger.info("built kernels.c for this CPU: %s", path.name)
            return True
        os.unlink(temporary)
        errors.append(done.stderr.strip()[-500:])
    logger.warning("kernels.c did not build (%s): the decoding step runs on torch alone", " | ".join(errors))
    return False


def _cpu_flags() -> str:
    """What ``-march=native`` depends on: the CPU's model and every feature flag."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(wanted[:2]) + os.uname().machine
