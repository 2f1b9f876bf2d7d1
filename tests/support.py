"""Real processes for tests: redis-server, workers and API servers on free ports; and what more than
one test file shares: requests and their checks, the tools and schemas of the constrained-output
tests, the routes and their scopes, the reasoning template of the test models.

Test files import from here (or from ``tests/engine/support.py``, ``tests/unit/tasks.py``,
``tests/faults.py``, ``tests/proxy.py``, ``tests/replication.py``), never from one another."""

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import redis.asyncio as aioredis
from httpx_sse import aconnect_sse

from lmsp_core import wire
from lmsp_core.ports import free_port
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import load_settings
from lmsp_core.store import connections, registry
from lmsp_core.store.tenants import credentials

ROOT = Path(__file__).resolve().parent.parent
SECURE_CORS_ORIGIN = "https://app.example"  # the one origin the secure_api fixture allows

# ChatML whose generation prompt opens a reasoning section (as DeepSeek-R1's does), and which renders
# the reasoning of an assistant turn that has some (as Qwen3's does for the current turn)
REASONING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n'"
    " + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
REASONING_BUDGET = 16


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 60, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def redis_binary() -> str:
    return shutil.which("redis-server") or "redis-server"


class RedisServer:
    """A redis-server of the test's own, which a test may stop and start again (as the replica of
    the Redis on port ``replica_of``)."""

    def __init__(self, appendonly: bool = False) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="lmsp-redis-"))
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def settings(self) -> dict[str, Any]:
        """The LMSP settings (``redis_*``) of a service that uses this Redis."""
        return {"redis_url": self.url}

    @property
    def log(self) -> Path:
        return self.dir / "redis.log"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def start(self, replica_of: int | None = None) -> None:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--logfile", str(self.log)]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
            self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self) -> aioredis.Redis:
        return aioredis.Redis.from_url(self.url)


class SentinelServer:
    """``redis-server --sentinel`` watching the primary ``master`` (its config file, which Sentinel
    rewrites, in a directory of its own). Short timeouts, so that a failover takes seconds."""

    def __init__(self, master: str, primary_port: int, down_after_ms: int = 2000,
                 failover_timeout_ms: int = 3000) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="lmsp-sentinel-"))
        self.config = self.dir / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {master} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {master} {down_after_ms}\n"
            f"sentinel failover-timeout {master} {failover_timeout_ms}\n")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen([redis_binary(), str(self.config), "--sentinel", "--logfile",
                                         str(self.dir / "sentinel.log")], stdout=subprocess.DEVNULL)
        wait_port(self.port)

    def cleanup(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.port, decode_responses=True)

    def output(self) -> str:
        log = self.dir / "sentinel.log"
        return log.read_text(errors="replace") if log.exists() else ""


class Service:
    """A process of ours (`lmsp api` or `lmsp worker`), its log kept in a file."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.args = args
        self.env = env
        self.log = Path(tempfile.mkstemp(prefix=f"lmsp-{name}-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "Service":
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "lmsp.cli", *self.args], env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        return self

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM) without waiting for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def service_env(redis_url: str, **settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")}
    env["LMSP_REDIS_URL"] = redis_url
    env["PYTHONUNBUFFERED"] = "1"
    env["LMSP_TORCH_THREADS"] = "1"  # several workers share 2 cores
    for name, value in settings.items():
        if value is not None:  # None: the setting's own default
            env[f"LMSP_{name.upper()}"] = str(value)
    return env


class Api(Service):
    """An API process; without settings saying otherwise it runs open on loopback (``LMSP_AUTH=none``)
    and without rate or stream limits, as the tests of everything but security expect."""

    def __init__(self, redis_url: str, **settings: Any) -> None:
        settings = {"auth": "none", "rate_limit": 0, "max_streams": 0, **settings}
        self.port = free_port()
        super().__init__(["api", "--port", str(self.port)], service_env(redis_url, **settings), "api")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Api":
        super().start()
        wait_port(self.port)
        return self


class Worker(Service):
    def __init__(self, redis_url: str, models: list[str], **settings: Any) -> None:
        args = ["worker", *[arg for model in models for arg in ("--model", model)]]
        super().__init__(args, service_env(redis_url, **settings), "worker")
        self.redis_url = redis_url
        self.models = models

    async def ready(self, timeout: float = 120) -> "Worker":
        """Wait until this process heartbeats in Redis as ready (warmed up; the Redis its settings name: a
        URL, or sentinels)."""
        assert self.process is not None
        client = connections.connect(load_settings(self.env))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"worker exited:\n{self.output()[-3000:]}")
                for info in await registry.live_workers(client):
                    if info.pid == self.process.pid and info.state == "ready":
                        return self
                await asyncio.sleep(0.1)
        finally:
            await connections.close(client)
        raise TimeoutError(f"worker not ready:\n{self.output()[-3000:]}")


def tiny_spec(model_id: str, **fields: Any) -> dict[str, Any]:
    """A model spec with tiny-random's weights (the same seed, so the same greedy text), in float32 and
    uncompiled as every test model: the same tokens on any CPU, and no wait for a compiler."""
    return {"id": model_id, "source": "tiny-random", "context_window": 2048, "max_output_tokens": 1024,
            "capabilities": ["streaming"], "dtype": "float32", "compile": False} | fields


@contextlib.asynccontextmanager
async def running(worker: "Worker") -> AsyncIterator["Worker"]:
    """The worker started and ready; stopped on the way out."""
    worker.start()
    try:
        yield await worker.ready()
    finally:
        worker.stop()


def user_input(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def body(model: str = "tiny-random", text: str = "Hello there", **fields: Any) -> dict[str, Any]:
    return {"model": model, "input": user_input(text), **fields}


class SseEvent(msgspec.Struct):
    id: int | None
    event: str
    data: dict[str, Any]


async def sse_events(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> AsyncIterator[SseEvent]:
    async with aconnect_sse(client, method, url, **kwargs) as source:
        source.response.raise_for_status()
        async with aclosing(source.aiter_sse()) as sses:
            async for sse in sses:
                if not sse.data:
                    continue  # a comment (heartbeat)
                yield SseEvent(int(sse.id) if sse.id else None, sse.event, msgspec.json.decode(sse.data))


async def collect(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> list[SseEvent]:
    return [event async for event in sse_events(client, method, url, **kwargs)]


class TokenFactory:
    """Creates tokens, each for a fresh principal unless one is given."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def __call__(self, scopes: list[str] | None = None, principal: str | None = None) -> tuple[str, str]:
        """A new token and its principal."""
        principal = principal or f"p-{uuid.uuid4().hex[:12]}"
        granted = list(credentials.GRANTABLE) if scopes is None else scopes
        token, _ = await credentials.create(self.redis, principal, granted)
        return token, principal


async def task_of_response(redis: aioredis.Redis, response_id: str) -> dict[bytes, bytes]:
    """The task hash behind a response, stored or not."""
    async for key in redis.scan_iter(match="lmsp:task:{*}", count=1000):
        if key.endswith(b"}") and await redis.hget(key, "response_id") == response_id.encode():
            return await redis.hgetall(key)
    raise AssertionError(f"no task for {response_id}")


async def final_status(redis: aioredis.Redis, response_id: str, timeout: float = 10) -> dict[bytes, bytes]:
    """The task hash behind a response once final, or as it is after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        task = await task_of_response(redis, response_id)
        if task[b"status"].decode() in wire.FINAL_STATUSES or asyncio.get_running_loop().time() > deadline:
            return task
        await asyncio.sleep(0.05)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def tasks_of(redis: aioredis.Redis, principal: str) -> list[str]:
    """Ids of the task records (tasks and direct responses) that belong to a principal."""
    found = []
    async for key in redis.scan_iter(match="lmsp:task:{*}", count=1000):
        if await redis.type(key) == b"hash" and await redis.hget(key, "owner") == principal.encode():
            found.append((await redis.hget(key, "id")).decode())
    return found


# what the API tests share: problem documents, task logs, prompts as a worker renders them, routes,
# and the tools and schemas of the constrained-output tests (tests/e2e and tests/engine/test_closing.py)
PROBLEM = "application/problem+json"


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.headers["lmsp-version"] == "1.0"
    problem: dict[str, Any] = response.json()
    assert {"type", "title", "status", "detail", "code"} <= set(problem)
    assert problem["status"] == status and problem["code"] == code
    assert problem["type"] == f"urn:lmsp:problem:{code}"
    assert "Traceback" not in response.text
    return problem


def logged(received: list[SseEvent]) -> list[SseEvent]:
    """The events of the task's log (without the id-less queue notices a client may ask for)."""
    return [e for e in received if e.event != wire.QUEUED]


def assert_complete_log(log: list[SseEvent], start: int = 1) -> None:
    assert [e.id for e in log] == list(range(start, start + len(log)))
    assert [e.event for e in log].count(wire.COMPLETED) + [e.event for e in log].count(wire.INCOMPLETE) == 1
    assert log[-1].event in wire.FINAL_EVENTS


async def render(redis: aioredis.Redis, model: str, items: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None = None) -> tuple[str, int]:
    """The prompt the worker must have built for these items, and its length in tokens."""
    card = await registry.load_card(redis, model)
    assert card is not None
    request = msgspec.convert({"model": model, "input": items, "tools": tools}, wire.ResponseRequest)
    renderer = PromptRenderer(card)
    return renderer.render(request.input, request.tools), len(renderer.prompt_ids(request))


def as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the input items that carry them into the next turn."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": item["content"], "id": item["id"]})
        else:
            items.append(item)
    return items


# the OpenAI routes and the scope each needs (tests/e2e/test_auth.py checks the table, and
# tests/e2e/test_openai_access.py their answers, OpenAI error objects)
OPENAI_ROUTES: list[tuple[str, str, str | None]] = [
    ("POST", "/v1/responses", credentials.RESPONSES_WRITE),
    ("GET", "/v1/responses/{response_id}", credentials.RESPONSES_READ),
    ("POST", "/v1/responses/{response_id}/cancel", credentials.TASKS_WRITE),
    ("DELETE", "/v1/responses/{response_id}", credentials.RESPONSES_WRITE),
    ("GET", "/v1/responses/{response_id}/input_items", credentials.RESPONSES_READ),
    ("POST", "/v1/chat/completions", credentials.RESPONSES_WRITE),
    ("GET", "/v1/models", credentials.MODELS_READ),
    ("GET", "/v1/models/{model}", credentials.MODELS_READ),
    ("POST", "/v1/files", credentials.TASKS_WRITE),
    ("GET", "/v1/files", credentials.TASKS_READ),
    ("GET", "/v1/files/{file_id}", credentials.TASKS_READ),
    ("GET", "/v1/files/{file_id}/content", credentials.TASKS_READ),
    ("DELETE", "/v1/files/{file_id}", credentials.TASKS_WRITE),
    ("POST", "/v1/batches", credentials.TASKS_WRITE),
    ("GET", "/v1/batches", credentials.TASKS_READ),
    ("GET", "/v1/batches/{batch_id}", credentials.TASKS_READ),
    ("POST", "/v1/batches/{batch_id}/cancel", credentials.TASKS_WRITE),
]


CITIES = ["Hangzhou", "Paris", "Lagos", "Lima"]

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"enum": CITIES}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city"]}},
    {"type": "function", "name": "add", "description": "Add two integers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["a", "b"]}},
    {"type": "function", "name": "search", "description": "Search the web.",
     "parameters": {"type": "object",
                    "properties": {"query": {"type": "string", "maxLength": 16},
                                   "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                                   "filters": {"type": "object",
                                               "properties": {"lang": {"enum": ["en", "fr", "zh"]},
                                                              "safe": {"type": "boolean"}},
                                               "required": ["lang"]}},
                    "required": ["query", "filters"]}},
    {"type": "function", "name": "book", "description": "Book seats.",
     "parameters": {"type": "object",
                    "properties": {"seats": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                        "maximum": 60}, "minItems": 1, "maxItems": 3},
                                   "class": {"enum": ["economy", "business"]}},
                    "required": ["seats", "class"]}},
]
PARAMETERS = {tool["name"]: tool["parameters"] for tool in TOOLS}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 130}},
     "required": ["name", "age"]},
    {"type": "object",
     "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99,
                                                                     "maximum": 99},
                                                               "y": {"type": "integer", "minimum": -99,
                                                                     "maximum": 99}},
                              "required": ["x", "y"]},
                    "label": {"enum": ["a", "b", "c"]}},
     "required": ["point"]},
    {"type": "object",
     "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
                    "ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["tags", "ok", "score"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9},
                                                                 "kind": {"enum": ["x", "y"]}},
                                "required": ["id", "kind"]},
     "minItems": 1, "maxItems": 3},
    {"type": "object",
     "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": ["integer", "null"], "minimum": 100,
                                                                   "maximum": 599},
                    "details": {"type": "object", "properties": {"retry": {"type": "boolean"}}}},
     "required": ["status", "code", "details"]},
]


def assert_valid_calls(output: list[dict[str, Any]], allowed: set[str]) -> None:
    assert output, "no output"
    for item in output:
        assert item["type"] == "function_call", item
        assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
        assert item["name"] in allowed
        assert isinstance(item["arguments"], str)
        jsonschema.validate(json.loads(item["arguments"]), PARAMETERS[item["name"]])


# models given by path (tests/e2e/test_model_paths.py, tests/unit/test_modelpaths.py)
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}


def tiny_model_dir(path: Path, seed: int = 0, **config: Any) -> Path:
    """A transformers model directory as a newcomer would point at: tiny random Llama weights in
    safetensors (written with numpy: no torch in the test process) and the default model's tokenizer
    and chat template (as the API reads them from its files); ``config`` adds to config.json."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    from lmsp_core.requests import modelfiles
    from lmsp_core.requests.catalog import SMOLLM2

    card = modelfiles.card_from_files(SMOLLM2, Path(load_settings().model_cache))
    assert card is not None
    vocabulary = Tokenizer.from_str(card.tokenizer_json)
    size = vocabulary.get_vocab_size(with_added_tokens=True)
    settings = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": size,
                "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "hidden_act": "silu",
                "bos_token_id": vocabulary.token_to_id(card.bos_token or ""),
                "eos_token_id": vocabulary.token_to_id(card.eos_token or ""),
                **TINY_LLAMA, **config}
    hidden, inner = settings["hidden_size"], settings["intermediate_size"]
    kv = hidden // settings["num_attention_heads"] * settings["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (size, hidden), "model.norm.weight": (hidden,)}
    for i in range(settings["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {layer + "self_attn.q_proj.weight": (hidden, hidden), layer + "self_attn.k_proj.weight": (kv, hidden),
                   layer + "self_attn.v_proj.weight": (kv, hidden), layer + "self_attn.o_proj.weight": (hidden, hidden),
                   layer + "mlp.gate_proj.weight": (inner, hidden), layer + "mlp.up_proj.weight": (inner, hidden),
                   layer + "mlp.down_proj.weight": (hidden, inner), layer + "input_layernorm.weight": (hidden,),
                   layer + "post_attention_layernorm.weight": (hidden,)}
    random = np.random.default_rng(seed)
    # wide weights, as tiny-random's: peaked logits, greedy choices far from ties
    weights = {name: (np.ones(shape) if len(shape) == 1 else random.normal(0, 0.5, shape)).astype(np.float32)
               for name, shape in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(settings))
    (path / "tokenizer.json").write_text(card.tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "bos_token": card.bos_token, "eos_token": card.eos_token,
        "pad_token": card.eos_token, "chat_template": card.chat_template}))
    return path


def hf_cache(root: Path, repo: str, model: Path, revision: str = "0" * 40) -> Path:
    """``root`` laid out as huggingface_hub's cache (``HF_HUB_CACHE``) holding ``model``'s files as
    the snapshot ``revision`` of ``repo``, its main branch."""
    storage = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model, storage / "snapshots" / revision)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(revision)
    return root


class Received(msgspec.Struct, frozen=True):
    """One request a ``Receiver`` got: its path, headers (lower-case names) and body."""

    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    """A webhook receiver: an HTTP server in a thread of the test process that keeps every POST and
    answers each with the next of ``answers`` (200 once they run out), after ``delay`` seconds."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.answers: list[int] = []
        self.delay = 0.0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                time.sleep(receiver.delay)
                status = receiver.answers.pop(0) if receiver.answers else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        """The first ``count`` requests, once there are as many."""
        await wait_for(lambda: _now(len(self.received) >= count), timeout, f"{count} webhook requests")
        return self.received[:count]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def _now(value: Any) -> Any:
    return value


# --- OpenAI batches (tests/e2e/test_batches.py, test_webhooks.py) ---------------------------------

CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, text: str, tokens: int = 4, model: str = "tiny-random") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                     "temperature": 0}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def run_batch(sdk: openai.AsyncOpenAI, lines: list[Any], window: str = "24h",
                    endpoint: str = CHAT) -> tuple[Any, Any]:
    source = await sdk.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=source.id, endpoint=endpoint,  # type: ignore[arg-type]
                                     completion_window=window)  # type: ignore[arg-type]
    return source, batch


async def until_final(sdk: openai.AsyncOpenAI, batch_id: str, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)


async def batch_lines(sdk: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await sdk.files.content(file_id)
    return [json.loads(line) for line in content.content.splitlines() if line.strip()]
