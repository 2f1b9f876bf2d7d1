"""One process at a time for work whose result the model cache keeps: a C build, a CPU's measured
figures, a converted model. Workers starting together on an empty cache (``--gpus``, a scaled service,
a test stack) would each do it at once, on the cores they share, and write over one another's
results; held, the first does it and the others find its result when they get the lock."""

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def held(lock: Path) -> Iterator[None]:
    """``lock`` (a file, made if missing) held exclusively until the block ends, or the process dies."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        yield
