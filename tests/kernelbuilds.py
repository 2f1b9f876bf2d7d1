"""kernels.c built for an older CPU than the host's, so that every class's code runs on any x86 test host."""

from pathlib import Path

import pytest

from workers import kernels


def built_for(march: str, directory: Path, monkeypatch: pytest.MonkeyPatch) -> kernels.Kernels | None:
    """kernels.c built into ``directory`` by a compiler that takes ``-march={march}`` for ``-march=native``
    (``$CC`` stays the wrapper for the rest of the test)."""
    directory.mkdir(parents=True, exist_ok=True)
    compiler = directory / "cc"
    compiler.write_text(f'#!/bin/sh\nfor a; do shift; [ "$a" = -march=native ] && a=-march={march}; '
                        'set -- "$@" "$a"; done\nexec cc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    return kernels.load(directory / "kernels")
