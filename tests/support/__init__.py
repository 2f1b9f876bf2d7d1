"""What more than one test file shares, one module a concept; test files import the names from here
(``from tests.support import Api, body``), as httpx's users do from ``httpx``.

- ``waiting``: polling a condition, waiting for a port.
- ``redisservers``: redis-server and Sentinel processes on free ports.
- ``services``: our processes (``lmsp api``, ``lmsp worker``) and the environment they run with.
- ``commands``: an ``lmsp`` command run in the test process, as its console script runs it.
- ``sse``: server-sent events as a client reads them; the checks of a task's event log.
- ``problems``: the problem documents (RFC 9457) of every refusal.
- ``requests``: request bodies; output items carried into the next turn.
- ``tokens``: bearer tokens for fresh principals; the OpenAI routes and their scopes.
- ``tasks``: task records read straight from Redis.
- ``models``: the test models, the reasoning template, the prompt a worker renders, model directories.
- ``tools``: the tools and schemas of the constrained-output tests.
- ``webhooks``: a webhook receiver in the test process.
- ``batches``: OpenAI batches through the official client.
- ``openresponses``: what Open Responses' schemas require of a response object and stream events.

Beside this package: ``tests/rediscluster.py`` (a local Redis Cluster), ``tests/replication.py`` and
``tests/failover.py`` (Sentinel), ``tests/faults.py`` (killing and restarting processes),
``tests/proxy.py``, ``tests/otlp.py`` (an OTLP receiver), ``tests/backends.py`` (a test on both Redis
deployments), ``tests/engine/support.py`` and ``tests/unit/tasks.py``. Test files never import from one
another.
"""

from lmsp_core.ports import free_port
from tests.support.batches import CHAT, batch_lines, chat_line, jsonl, run_batch, until_final
from tests.support.commands import run_lmsp
from tests.support.models import (
    REASONING_BUDGET,
    REASONING_TEMPLATE,
    TINY_LLAMA,
    hf_cache,
    render,
    tiny_model_dir,
    tiny_spec,
)
from tests.support.openresponses import RESPONSE_RESOURCE, event_problems, resource_problems
from tests.support.problems import PROBLEM, assert_problem
from tests.support.redisservers import RedisServer, SentinelServer, redis_binary
from tests.support.requests import as_input, body, user_input
from tests.support.services import (
    ROOT,
    SECURE_CORS_ORIGIN,
    Api,
    Service,
    Worker,
    all_running,
    ready_all,
    running,
    service_env,
    start_all,
    stop_all,
)
from tests.support.sse import SseEvent, assert_complete_log, collect, logged, sse_events
from tests.support.tasks import final_status, task_of_response, tasks_of
from tests.support.tokens import OPENAI_ROUTES, TokenFactory, bearer
from tests.support.tools import CITIES, PARAMETERS, SCHEMAS, TOOLS, assert_valid_calls
from tests.support.waiting import wait_for, wait_port
from tests.support.webhooks import Received, Receiver

__all__ = [
    "CHAT", "CITIES", "OPENAI_ROUTES", "PARAMETERS", "PROBLEM", "REASONING_BUDGET", "REASONING_TEMPLATE",
    "RESPONSE_RESOURCE", "ROOT", "SCHEMAS", "SECURE_CORS_ORIGIN", "TINY_LLAMA", "TOOLS", "Api", "Received",
    "Receiver", "RedisServer", "SentinelServer", "Service", "SseEvent", "TokenFactory", "Worker", "all_running",
    "as_input", "assert_complete_log", "assert_problem", "assert_valid_calls", "batch_lines", "bearer", "body",
    "chat_line", "collect", "event_problems", "final_status", "free_port", "hf_cache", "jsonl", "logged",
    "ready_all", "redis_binary", "render", "resource_problems", "run_batch", "run_lmsp", "running", "service_env",
    "sse_events", "start_all", "stop_all", "task_of_response", "tasks_of", "tiny_model_dir", "tiny_spec",
    "until_final", "user_input", "wait_for", "wait_port",
]
