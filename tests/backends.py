"""The store's end-to-end tests on both Redis deployments: a module that imports these fixtures
runs each of its tests against the session's single Redis and against a three-shard Redis Cluster
(each shard a primary and a replica), every process of the second stack configured with
``LMSP_REDIS_CLUSTER`` only.

    from tests.backends import (  # noqa: F401 (fixtures: both deployments)
        backend, client, eager_worker, make_token, redis, redis_settings, secure, served)

The cluster stack (``conftest``: ``redis_cluster``, ``cluster_api``, ...) starts with the first test
that asks for it.
"""

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from lmsp_core.settings import load_settings
from lmsp_core.store import connections
from tests.support import Api, TokenFactory, Worker

BACKENDS = ["redis", "cluster"]
# fixtures of the single Redis's stack only: a test that uses one runs there alone
SINGLE_ONLY = {"api", "secure_api", "sdk", "redis_server", "tiny_worker", "variant_worker", "patient_worker",
               "short_lived"}


def parametrize(metafunc: pytest.Metafunc) -> None:
    """(``conftest.pytest_generate_tests``) Both backends for a test that asks for ``backend``
    through these fixtures, unless it also uses a fixture of the single Redis's stack."""
    if "backend" in metafunc.fixturenames:
        single = SINGLE_ONLY & set(metafunc.fixturenames)
        metafunc.parametrize("backend", ["redis"] if single else BACKENDS, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _on(backend: str, request: pytest.FixtureRequest, name: str) -> Any:
    """The session fixture ``name`` of the backend's stack (``cluster_<name>`` on the cluster)."""
    return request.getfixturevalue(name if backend == "redis" else f"cluster_{name}")


# (the stacks are looked up by synchronous fixtures: an asynchronous one cannot start the session's
# asynchronous fixtures from inside the running loop)


@pytest.fixture
def served(backend: str, request: pytest.FixtureRequest) -> tuple[Api, Api]:
    """The backend's APIs (open, and with bearer tokens), with its tiny-random worker ready."""
    _on(backend, request, "tiny_worker")
    return _on(backend, request, "api"), _on(backend, request, "secure_api")


@pytest_asyncio.fixture
async def client(served: tuple[Api, Api]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served[0].url, timeout=60) as http:
        yield http


@pytest_asyncio.fixture
async def secure(served: tuple[Api, Api]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served[1].url, timeout=60) as http:
        yield http


@pytest.fixture
def eager_worker(backend: str, request: pytest.FixtureRequest) -> Worker:
    worker: Worker = request.getfixturevalue("single_eager_worker" if backend == "redis" else "cluster_eager_worker")
    return worker


@pytest.fixture
def redis_settings(backend: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(request.getfixturevalue("redis_server" if backend == "redis" else "redis_cluster").settings)


@pytest_asyncio.fixture
async def redis(redis_settings: dict[str, Any]) -> AsyncIterator[Any]:
    """A client of the backend's Redis, as the service makes it (on the cluster: its cluster client)."""
    connection = connections.connect(load_settings({}, **redis_settings))
    yield connection
    await connections.close(connection)


@pytest.fixture
def make_token(redis: Any) -> TokenFactory:
    return TokenFactory(redis)
