"""Helpers of the in-process engine and model tests: a generation's sink, kernels.c built for this
host (the build the session's workers share) or for an older CPU, and a count of the steps whose
layers ran in one call."""

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from lmsp_core.settings import load_settings
from workers.engine.core import Finish, Generation
from workers.engine.sampling import Scores
from workers.model import loader
from workers.model.cpu import kernels, layerstep


class Collector:
    """A sink that keeps a generation's tokens and why it finished."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.scores: list[Scores | None] = []
        self.reason: Finish | None = None
        self.done = asyncio.Event()

    def on_token(self, seq: Generation, token: int, scores: Scores | None = None) -> None:
        self.tokens.append(token)
        self.scores.append(scores)

    def on_finish(self, seq: Generation, reason: Finish, error: BaseException | None) -> None:
        self.reason = reason
        self.done.set()


def shared_kernel_dir() -> Path:
    """Where the workers of the session build kernels.c: one build (seconds) serves every test."""
    return loader.kernel_dir(Path(load_settings().model_cache))


def built_for(march: str, directory: Path, monkeypatch: pytest.MonkeyPatch) -> kernels.Kernels | None:
    """kernels.c built into ``directory`` by a compiler that takes ``-march={march}`` for ``-march=native``
    (``$CC`` stays the wrapper for the rest of the test), so that every class's code runs on any x86
    test host."""
    directory.mkdir(parents=True, exist_ok=True)
    compiler = directory / "cc"
    compiler.write_text(f'#!/bin/sh\nfor a; do shift; [ "$a" = -march=native ] && a=-march={march}; '
                        'set -- "$@" "$a"; done\nexec cc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    return kernels.load(directory / "kernels")


def one_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each step whose layers run in one call (``layerstep.LayerStep``) from now on."""
    calls: list[int] = []
    one_call = layerstep.LayerStep.__call__

    def counted(self: layerstep.LayerStep, x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return one_call(self, x, *args)

    monkeypatch.setattr(layerstep.LayerStep, "__call__", counted)
    return calls
