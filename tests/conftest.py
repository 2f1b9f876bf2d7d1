"""Shared fixtures: one redis-server for the session and the processes on it, started side by side
when the first test needs one of them (``stack``): the APIs and workers that some collected test
uses, and the same stack on a Redis Cluster for ``tests.backends``. ``scripts/test`` runs three
pytest processes (pytest-xdist), each a session: the tests of each stack run in one of them
(``tests.sharing``).

The shared API runs with ``LMSP_AUTH=none`` (loopback); ``secure_api`` is a second API process on
the same Redis with bearer tokens, for the security tests; a few more serve a test file's settings
(``_process`` says which). A test file that needs a process with other settings adds it there rather
than starting its own. Tests that break things (kill a worker, restart Redis) make their own
processes instead.
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
from tests import backends, sharing
from tests.rediscluster import LocalCluster
from tests.sharing import SINGLE, group, needed, process_group
from tests.support import (
    REASONING_BUDGET,
    REASONING_TEMPLATE,
    SECURE_CORS_ORIGIN,
    Api,
    RedisServer,
    Service,
    TokenFactory,
    Worker,
    ready_all,
    stop_all,
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
    sharing.mark_groups(items)


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


@pytest.fixture(scope="session")
def variant_models_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The catalog of ``variant_worker``: the tests' own, but for a 24-token context window of
    tiny-mismatch, smaller than the API's, so that the API accepts what the worker refuses."""
    mismatch = tiny_spec("tiny-mismatch", context_window=24, max_output_tokens=16)
    path = tmp_path_factory.mktemp("variant") / "models.json"
    path.write_text(json.dumps([mismatch if spec["id"] == "tiny-mismatch" else spec for spec in TEST_MODELS]))
    return str(path)


# --- the session's processes: the first test that needs one starts all that the run will use ------

# Each is started by the ``stack`` below, side by side with the others (a start is mostly its imports,
# torch's for a worker: started one after another, they would queue for the cores in turn).
def _process(name: str, redis_url: str, files: dict[str, str], **redis: Any) -> Api | Worker:
    """The session's process ``name`` (unstarted) on a Redis; ``files``: the catalogs by name."""
    models = files["models"]
    if name == "api":
        return Api(redis_url, models_file=models, sse_heartbeat=1, **redis)
    if name == "secure_api":  # bearer tokens, two open streams per principal and CORS for one origin
        return Api(redis_url, models_file=models, sse_heartbeat=1, auth="tokens", max_streams=2,
                   cors_origins=SECURE_CORS_ORIGIN, **redis)
    if name == "second_api":  # bearer tokens and no limits (see test_fairness.py)
        return Api(redis_url, models_file=models, auth="tokens")
    if name == "limited_api":  # five requests a minute per principal, small bodies (see test_limits.py)
        return Api(redis_url, models_file=models, auth="tokens", rate_limit=5, rate_window=60, max_body_bytes=4096)
    if name == "small_api":  # files of a few KiB and batches of three requests (see test_files.py)
        return Api(redis_url, models_file=models, max_file_bytes=4096, max_batch_lines=3)
    if name == "tenant_api":  # names every principal in its metrics: the session makes more than the
        # default cap (LMSP_METRICS_PRINCIPALS), see test_observability.py
        return Api(redis_url, models_file=models, auth="tokens", metrics_principals=100_000)
    if name == "fair_worker":  # tiny-fair's four slots, which tenants compete for (see test_fairness.py)
        return Worker(redis_url, ["tiny-fair"], models_file=models)
    if name == "smollm2_worker":  # the real SmolLM2, uncompiled (``TEST_MODELS``; see test_smollm2.py)
        return Worker(redis_url, [SMOLLM2.id], models_file=models)
    if name == "variant_worker":  # the test-only model variants, on their own catalog
        return Worker(redis_url, ["tiny-reasoning", "tiny-serial", "tiny-mismatch"], models_file=files["variant"])
    # appends its tasks' events after every step (eager) or every 3 s (patient)
    flush = {"tiny_worker": None, "eager_worker": 0, "patient_worker": 3}[name]
    model = {"tiny_worker": "tiny-random", "eager_worker": "tiny-eager", "patient_worker": "tiny-patient"}[name]
    return Worker(redis_url, [model], models_file=models, event_flush_interval=flush, **redis)


class Stack:
    """The session's processes by name; one that no collected test was seen to use starts when asked."""

    def __init__(self, request: pytest.FixtureRequest, redis_url: str, files: dict[str, str]) -> None:
        self.request = request
        self.redis_url = redis_url
        self.files = files
        self.processes: dict[str, Api | Worker] = {}

    def _make(self, name: str) -> Api | Worker:
        if not name.startswith("cluster_"):
            return _process(name, self.redis_url, self.files)
        cluster: LocalCluster = self.request.getfixturevalue("redis_cluster")
        settings = _cluster_service(cluster)
        return _process(name.removeprefix("cluster_"), settings.pop("redis_url"), self.files, **settings)

    async def start(self, names: set[str]) -> None:
        """Start them at once; the cluster forms while the single Redis's processes import."""
        made = {name: self._make(name) for name in sorted(names & set(SINGLE))}
        for service in made.values():
            Service.start(service)
        self.processes.update(made)  # stopped at the end even if one of them never gets ready
        if "redis_cluster" in names:
            self.request.getfixturevalue("redis_cluster")
        clustered = {name: self._make(name) for name in sorted(names - set(SINGLE) - {"redis_cluster"})}
        for service in clustered.values():
            Service.start(service)
        self.processes.update(clustered)
        await ready_all(*self.processes.values(), timeout=300)

    async def get(self, name: str) -> Any:
        """Process ``name``; if not yet started, with every one that the tests of its group use."""
        if name not in self.processes:
            wanted = process_group(name)
            items = [item for item in self.request.session.items if group(item) == wanted]
            await self.start((needed(items) | {name}) - set(self.processes))
        return self.processes[name]

    def stop(self) -> None:
        stop_all(*self.processes.values())


@pytest_asyncio.fixture(scope="session")
async def stack(request: pytest.FixtureRequest, redis_server: RedisServer, models_file: str,
                variant_models_file: str) -> AsyncIterator[Stack]:
    """The session's processes, started by the first test of each group that uses one of them: every
    one the group's tests use (one group on the single Redis, one on the cluster: ``tests.sharing``)."""
    processes = Stack(request, redis_server.url, {"models": models_file, "variant": variant_models_file})
    try:
        yield processes
    finally:
        processes.stop()


@pytest_asyncio.fixture(scope="session")
async def tiny_worker(stack: Stack) -> Worker:
    worker: Worker = await stack.get("tiny_worker")
    return worker


@pytest_asyncio.fixture(scope="session")
async def variant_worker(stack: Stack) -> Worker:
    """Serves the test-only model variants; tiny-mismatch with a 24-token context window, smaller than
    the API's, so that the API accepts what the worker refuses (see test_failures.py)."""
    worker: Worker = await stack.get("variant_worker")
    return worker


@pytest_asyncio.fixture(scope="session")
async def eager_worker(stack: Stack) -> Worker:
    """A worker that appends its tasks' events after every step: streams of many small events."""
    worker: Worker = await stack.get("eager_worker")
    return worker


@pytest.fixture(scope="session")
def single_eager_worker(eager_worker: Worker) -> Worker:
    """``eager_worker`` under the name ``tests.backends`` looks it up by."""
    return eager_worker


@pytest_asyncio.fixture(scope="session")
async def patient_worker(stack: Stack) -> Worker:
    """A worker that appends its tasks' events every 3 s."""
    worker: Worker = await stack.get("patient_worker")
    return worker


@pytest_asyncio.fixture(scope="session")
async def api(stack: Stack) -> Api:
    server: Api = await stack.get("api")
    return server


@pytest_asyncio.fixture(scope="session")
async def secure_api(stack: Stack) -> Api:
    """An API that authenticates bearer tokens, allows two open streams per principal and CORS for
    one origin."""
    server: Api = await stack.get("secure_api")
    return server


@pytest_asyncio.fixture(scope="session")
async def second_api(stack: Stack) -> Api:
    server: Api = await stack.get("second_api")
    return server


@pytest_asyncio.fixture(scope="session")
async def limited_api(stack: Stack) -> Api:
    server: Api = await stack.get("limited_api")
    return server


@pytest_asyncio.fixture(scope="session")
async def small_api(stack: Stack) -> Api:
    server: Api = await stack.get("small_api")
    return server


@pytest_asyncio.fixture(scope="session")
async def tenant_api(stack: Stack) -> Api:
    server: Api = await stack.get("tenant_api")
    return server


@pytest_asyncio.fixture(scope="session")
async def smollm2_worker(stack: Stack) -> Worker:
    worker: Worker = await stack.get("smollm2_worker")
    return worker


@pytest_asyncio.fixture(scope="session")
async def fair_worker(stack: Stack) -> Worker:
    worker: Worker = await stack.get("fair_worker")
    return worker


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
async def cluster_tiny_worker(stack: Stack) -> Worker:
    worker: Worker = await stack.get("cluster_tiny_worker")
    return worker


@pytest_asyncio.fixture(scope="session")
async def cluster_eager_worker(stack: Stack) -> Worker:
    worker: Worker = await stack.get("cluster_eager_worker")
    return worker


@pytest_asyncio.fixture(scope="session")
async def cluster_api(stack: Stack) -> Api:
    server: Api = await stack.get("cluster_api")
    return server


@pytest_asyncio.fixture(scope="session")
async def cluster_secure_api(stack: Stack) -> Api:
    server: Api = await stack.get("cluster_secure_api")
    return server


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
