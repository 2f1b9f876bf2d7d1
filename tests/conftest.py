"""Shared fixtures: one redis-server, one tiny-random worker and one API for the session.

The shared API runs with ``LMSP_AUTH=none`` (loopback); ``secure_api`` is a second API process on
the same Redis with bearer tokens, for the security tests. Tests that break things (kill a worker,
restart Redis) make their own processes instead.
"""

import json
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from lmsp_core.requests.catalog import SMOLLM2
from tests import backends
from tests.rediscluster import LocalCluster
from tests.support import (
    REASONING_BUDGET,
    REASONING_TEMPLATE,
    SECURE_CORS_ORIGIN,
    Api,
    RedisServer,
    TokenFactory,
    Worker,
    running,
    tiny_spec,
)

# models only the tests use; "tiny-unserved" never gets a worker
TEST_MODELS: list[dict[str, Any]] = [
    tiny_spec("tiny-unserved"),
    # its worker (``variant_worker``) is configured with a 24-token context window (see test_failures.py)
    tiny_spec("tiny-mismatch"),
    # never gets a worker; its queue holds at most two tasks (see test_limits.py)
    tiny_spec("tiny-queue", max_queue_depth=2),
    # served by ``variant_worker``: a reasoning model whose budget closes the section (random
    # weights never do), and a model that runs one task at a time (see test_priority.py)
    tiny_spec("tiny-reasoning", capabilities=["streaming", "tools", "structured_output"],
              chat_template=REASONING_TEMPLATE, reasoning={"opened_by": "template", "budget": REASONING_BUDGET}),
    tiny_spec("tiny-serial", context_window=32768, max_output_tokens=32000, max_batch_size=1),
    # served by ``eager_worker``, which appends after every step: a delta a token, many small events
    tiny_spec("tiny-eager", capabilities=["streaming", "conversations"]),
    # served by ``patient_worker``, which appends every 3 s: what happens meanwhile is not in the log yet
    tiny_spec("tiny-patient", context_window=8192, max_output_tokens=8000),
    # served only by test_fairness.py's worker: four slots that tenants compete for
    tiny_spec("tiny-fair", max_batch_size=4),
    # served only by the per-GPU workers of test_gpus.py, one task at a time each
    tiny_spec("tiny-pinned", max_batch_size=1),
    # the default model as the tests run it: without compiling its decoding step (minutes)
    msgspec.to_builtins(msgspec.structs.replace(SMOLLM2, compile=False)),
]



def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    backends.parametrize(metafunc)


# --- the fast tier: ``scripts/test --fast`` (``pytest --fast``), the edit loop ------------------------

# Every test of tests/unit and tests/engine, and these end-to-end files, which between them take every
# route once, resume, cancel and one fault, on the single Redis (their runs on the cluster stay in the
# whole suite, as do the tests marked smollm2 or slow). A new end-to-end file is in the whole suite only.
FAST_E2E = {
    "test_responses.py",  # LMSP responses: synchronous, streamed, a closed stream cancels
    "test_tasks.py",  # tasks: create, follow, resume (Last-Event-ID, after), cancel queued and running
    "test_openai.py",  # /v1 through the official client: responses, chat, background, resume, cancel
    "test_openai_access.py",  # every /v1 route (files and batches too) and its error objects
    "test_models.py",
    "test_problems.py",
    "test_failures.py",  # the fault: a worker refuses a task, which ends failed
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", help="run the fast tier only (tests marked fast)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fast: in the fast tier (given by tests/conftest.py, FAST_E2E)")
    config.addinivalue_line("markers", "slow: most of a minute alone; in the whole suite, not the fast tier")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``--fast``, the other end-to-end files are not even imported (some build an app to collect)."""
    here = Path(__file__).parent / "e2e"
    if config.getoption("--fast") and collection_path.parent == here and collection_path.name.startswith("test_"):
        return collection_path.name not in FAST_E2E or None
    return None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_fast_tier(item):
            item.add_marker(pytest.mark.fast)
    if config.getoption("--fast"):
        kept = [item for item in items if item.get_closest_marker("fast")]
        config.hook.pytest_deselected(items=[item for item in items if not item.get_closest_marker("fast")])
        items[:] = kept


def _in_fast_tier(item: pytest.Item) -> bool:
    path = item.path.relative_to(Path(__file__).parent)
    callspec = getattr(item, "callspec", None)
    if item.get_closest_marker("smollm2") or item.get_closest_marker("slow"):
        return False
    if callspec is not None and callspec.params.get("backend") == "cluster":
        return False
    return path.parts[0] in ("unit", "engine") or (path.parts[0] == "e2e" and path.name in FAST_E2E)


@pytest.fixture(scope="session")
def models_file() -> Iterator[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(TEST_MODELS, handle)
    yield handle.name
    Path(handle.name).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest_asyncio.fixture(scope="session")
async def tiny_worker(redis_server: RedisServer, models_file: str) -> AsyncIterator[Worker]:
    async with running(Worker(redis_server.url, ["tiny-random"], models_file=models_file)) as worker:
        yield worker


@pytest.fixture(scope="session")
def variant_models_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The catalog of ``variant_worker``: the tests' own, but for a 24-token context window of
    tiny-mismatch, smaller than the API's, so that the API accepts what the worker refuses."""
    mismatch = tiny_spec("tiny-mismatch", context_window=24, max_output_tokens=16)
    path = tmp_path_factory.mktemp("variant") / "models.json"
    path.write_text(json.dumps([mismatch if spec["id"] == "tiny-mismatch" else spec for spec in TEST_MODELS]))
    return str(path)


@pytest_asyncio.fixture(scope="session")
async def variant_worker(redis_server: RedisServer, variant_models_file: str) -> AsyncIterator[Worker]:
    """One more worker, started by the first test that needs it, for the test-only model variants."""
    models = ["tiny-reasoning", "tiny-serial", "tiny-mismatch"]
    async with running(Worker(redis_server.url, models, models_file=variant_models_file)) as worker:
        yield worker


@pytest_asyncio.fixture(scope="session")
async def eager_worker(redis_server: RedisServer, models_file: str) -> AsyncIterator[Worker]:
    """A worker that appends its tasks' events after every step (``LMSP_EVENT_FLUSH_INTERVAL=0``):
    streams of many small events, whatever the model's speed."""
    worker = Worker(redis_server.url, ["tiny-eager"], models_file=models_file, event_flush_interval=0)
    async with running(worker):
        yield worker


@pytest.fixture(scope="session")
def single_eager_worker(eager_worker: Worker) -> Worker:
    """``eager_worker`` under the name ``tests.backends`` looks it up by."""
    return eager_worker


@pytest_asyncio.fixture(scope="session")
async def patient_worker(redis_server: RedisServer, models_file: str) -> AsyncIterator[Worker]:
    """A worker that appends its tasks' events every 3 s (``LMSP_EVENT_FLUSH_INTERVAL=3``)."""
    worker = Worker(redis_server.url, ["tiny-patient"], models_file=models_file, event_flush_interval=3)
    async with running(worker):
        yield worker


@pytest.fixture(scope="session")
def api(redis_server: RedisServer, models_file: str) -> Iterator[Api]:
    server = Api(redis_server.url, models_file=models_file, sse_heartbeat=1)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def secure_api(redis_server: RedisServer, models_file: str) -> Iterator[Api]:
    """An API that authenticates bearer tokens, allows two open streams per principal and CORS for
    one origin."""
    server = Api(redis_server.url, models_file=models_file, sse_heartbeat=1, auth="tokens", max_streams=2,
                 cors_origins=SECURE_CORS_ORIGIN)
    server.start()
    yield server
    server.stop()


# --- the same stack on a Redis Cluster, for the modules that use ``tests.backends`` ---------------


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """Three shards, each a primary and a replica."""
    cluster = LocalCluster(primaries=3, replicas=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _cluster_service(cluster: LocalCluster) -> dict[str, Any]:
    return {"redis_url": cluster.settings["redis_url"], "redis_cluster": cluster.settings["redis_cluster"]}


@pytest_asyncio.fixture(scope="session")
async def cluster_tiny_worker(redis_cluster: LocalCluster, models_file: str) -> AsyncIterator[Worker]:
    settings = _cluster_service(redis_cluster)
    worker = Worker(settings.pop("redis_url"), ["tiny-random"], models_file=models_file, **settings)
    async with running(worker):
        yield worker


@pytest_asyncio.fixture(scope="session")
async def cluster_eager_worker(redis_cluster: LocalCluster, models_file: str) -> AsyncIterator[Worker]:
    settings = _cluster_service(redis_cluster)
    worker = Worker(settings.pop("redis_url"), ["tiny-eager"], models_file=models_file, event_flush_interval=0,
                    **settings)
    async with running(worker):
        yield worker


@pytest.fixture(scope="session")
def cluster_api(redis_cluster: LocalCluster, models_file: str) -> Iterator[Api]:
    settings = _cluster_service(redis_cluster)
    server = Api(settings.pop("redis_url"), models_file=models_file, sse_heartbeat=1, **settings)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cluster_secure_api(redis_cluster: LocalCluster, models_file: str) -> Iterator[Api]:
    settings = _cluster_service(redis_cluster)
    server = Api(settings.pop("redis_url"), models_file=models_file, sse_heartbeat=1, auth="tokens", max_streams=2,
                 cors_origins=SECURE_CORS_ORIGIN, **settings)
    server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture
async def make_token(redis: aioredis.Redis) -> TokenFactory:
    return TokenFactory(redis)


@pytest_asyncio.fixture
async def secure(secure_api: Api, tiny_worker: Worker) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``secure_api`` (requests carry no token unless a test adds one)."""
    async with httpx.AsyncClient(base_url=secure_api.url, timeout=60) as http:
        yield http


@pytest_asyncio.fixture
async def client(api: Api, tiny_worker: Worker) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
        yield http


@pytest_asyncio.fixture
async def sdk(api: Api, tiny_worker: Worker) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official ``openai`` client of ``api``'s ``/v1`` routes."""
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield client
    finally:
        await client.close()


@pytest_asyncio.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    connection = redis_server.client()
    yield connection
    await connection.aclose()
