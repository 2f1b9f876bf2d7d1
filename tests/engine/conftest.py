"""Fixtures of the in-process engine and model tests: no API or worker process, the model in this one."""

from pathlib import Path

import pytest

from lmsp_core.requests.catalog import TINY_RANDOM
from lmsp_core.settings import load_settings
from workers.model import loader


@pytest.fixture(scope="module")
def tiny() -> loader.LoadedModel:
    """tiny-random, loaded once per test file, on one thread (a whole run's worker processes share the cores)."""
    loader.limit_threads(1)
    return loader.load(TINY_RANDOM, Path(load_settings().model_cache))
