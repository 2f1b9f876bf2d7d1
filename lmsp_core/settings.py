"""Service settings. Every field can be set with an environment variable ``LMSP_<NAME>``
(``LMSP_REDIS_URL``, ``LMSP_EVENT_RETENTION``, ...); command-line flags override the environment."""

import ipaddress
import os
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Seconds = Annotated[float, Meta(gt=0)]
Count = Annotated[int, Meta(ge=0)]  # 0: no limit

# per-principal limits of a service with bearer tokens, unless set (Settings.rate_limit, max_streams)
TOKENS_RATE_LIMIT = 600
TOKENS_MAX_STREAMS = 32


def _default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "lmsp")


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis Sentinel (docs/reliability.md, "Replication and failover"): comma-separated host:port of
    # the sentinels that watch the primary named redis_master. When set, every connection asks them
    # for the current primary, and redis_url gives only the database, user name, password and TLS.
    redis_sentinels: str = ""
    redis_master: str = "mymaster"
    # Redis Cluster (docs/reliability.md, "Redis Cluster"): comma-separated host:port of some of its
    # nodes, from which every client learns the rest. When set, redis_url gives only the user name,
    # password and TLS; it excludes redis_sentinels.
    redis_cluster: str = ""
    # replicas that must hold a write before it is acknowledged (a worker's events, a created or
    # cancelled task): Redis WAIT, giving up after redis_wait_timeout and going on with the primary
    # alone. None: 1 with sentinels or a cluster, 0 without.
    redis_wait_replicas: Annotated[int, Meta(ge=0)] | None = None
    redis_wait_timeout: Seconds = 0.1
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    default_model: str = "smollm2:135m-instruct"
    # a JSON file with a list of model specs, added to (or replacing by id) the built-in catalog
    models_file: str | None = None
    # the same list inline (JSON), added after it: the models named on the command line by path or
    # name (lmsp_core.requests.modelpaths), which `lmsp up` hands its worker this way
    model_specs: str = ""
    # comma-separated catalog ids the model listings show whether or not a worker runs them ("*": the
    # whole catalog); the specs of models_file and model_specs are listed anyway, the other built-in
    # models only while a live worker runs them. `lmsp up` and `lmsp api` add the models they are given
    listed_models: str = ""
    model_cache: str = msgspec.field(default_factory=_default_cache)
    # retention, enforced by Redis key expiry
    event_retention: Seconds = 3600.0
    task_retention: Seconds = 86400.0
    # SSE comment heartbeat while nothing else is sent
    sse_heartbeat: Seconds = 10.0
    # workers: liveness heartbeat, task leases, retries and the generation time limit
    worker_heartbeat: Seconds = 2.0
    worker_ttl: Seconds = 10.0
    lease_ttl: Seconds = 10.0
    # a worker appends its tasks' events at most this often (a run's first output at once): the tokens
    # between two appends share one delta event (docs/performance.md, "The path of an event")
    event_flush_interval: Annotated[float, Meta(ge=0, le=5)] = 0.02
    max_attempts: Annotated[int, Meta(ge=1)] = 3
    # how often each worker looks for tasks whose worker died (lapsed leases, lost jobs)
    reaper_interval: Seconds = 1.0
    job_timeout: Seconds = 3600.0
    # on SIGTERM a worker lets running tasks finish this long, then hands the rest back
    shutdown_grace: Annotated[float, Meta(ge=0)] = 5.0
    # CPU threads of a worker's model; 0: one fewer than the machine's cores (at least one), so the
    # worker's event loop, the API and Redis keep a core: oversubscribed intra-op threads spin and
    # lose most of their throughput (measured: docs/performance.md)
    torch_threads: Annotated[int, Meta(ge=0)] = 0
    # on a CPU, long sequences' attention takes a second thread where torch's threads leave a core
    # (workers/model/cpu/kernels.c, "The helper"; measured: docs/performance.md)
    attention_helper: bool = True
    # security (docs/protocol.md, "Security"): "none" is refused unless the API binds a loopback address
    auth: Literal["tokens", "none"] = "tokens"
    # comma-separated origins allowed by CORS ("*" for any); empty: CORS off
    cors_origins: str = ""
    idempotency_ttl: Seconds = 86400.0
    # stored responses (store: true), counted from the last turn that continued their conversation, and
    # OpenAI's conversations (/v1/conversations), counted from their last change
    response_retention: Seconds = 30 * 86400.0
    # OpenAI's files (/v1/files, docs/protocol.md, "Files (OpenAI)"), counted from their upload, as
    # OpenAI keeps batch files
    file_retention: Seconds = 30 * 86400.0
    # request limits
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 * 1024 * 1024
    max_input_items: Annotated[int, Meta(ge=1)] = 1024
    max_tools: Annotated[int, Meta(ge=0)] = 128
    max_input_chars: Annotated[int, Meta(ge=1)] = 1_000_000
    # an uploaded file (POST /v1/files, which alone may exceed max_body_bytes), and the requests
    # (non-blank lines) of a batch input file
    max_file_bytes: Annotated[int, Meta(ge=1024)] = 100 * 1024 * 1024
    max_batch_lines: Annotated[int, Meta(ge=1)] = 50_000
    # per principal (docs/protocol.md, "Limits"): requests per rate window (fixed window), open SSE
    # streams; 0: no limit. Unset: 600 and 32 with tokens, no limit with auth "none", whose one
    # principal is every local client: limits that keep tenants apart would only throttle it
    rate_limit: Count | None = None
    rate_window: Seconds = 60.0
    max_streams: Count | None = None
    # an open stream's slot lapses this long after its API process stops renewing it (a crash)
    stream_lease: Seconds = 30.0
    # queued tasks per model before new work gets 503 server_busy (a model spec may override it)
    max_queue_depth: Count = 1000
    # priorities (docs/protocol.md, "Priorities"): a normal task is queued as if it had been created
    # this long before a low one, a high one twice this long
    priority_step: Annotated[float, Meta(ge=0)] = 300.0
    # fair share between principals (docs/queue.md, "Fair share between principals"): off, workers
    # start jobs in score order whoever owns them, and weights and quotas are not applied. Set it
    # alike on every API process and worker.
    fair_share: bool = True
    # a batch's lines that are tasks not yet ended, at most (docs/protocol.md, "Batches"): the rest
    # wait in the batch, so the queue stays short and interactive work is not buried
    batch_in_flight: Annotated[int, Meta(ge=1)] = 64
    # webhooks (docs/protocol.md, "Webhooks"): targets whose address is loopback, link-local, private,
    # unspecified, multicast or otherwise not global are refused unless this is set (a receiver on
    # this host or its network; tests)
    webhook_allow_private: bool = False
    # seconds between a failed delivery attempt and the next, comma-separated: one retry each, then
    # the delivery fails (Standard Webhooks' schedule: about a day in all)
    webhook_retry_delays: str = "5,300,1800,7200,18000,36000,36000"
    # one attempt in all (resolving, connecting, sending, reading the answer)
    webhook_timeout: Annotated[float, Meta(gt=0, le=60)] = 10.0
    # principals per model with series of their own in /metrics and rows in /status; the rest are summed as "~other"
    metrics_principals: Annotated[int, Meta(ge=1)] = 20
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_json: bool = False

    def __post_init__(self) -> None:
        parse_sentinels(self.redis_sentinels)  # a malformed list fails at start-up, not at the first use
        parse_sentinels(self.redis_cluster, "redis_cluster")
        if self.redis_cluster and self.redis_sentinels:
            raise ValueError("redis_cluster and redis_sentinels exclude each other: a cluster fails over by itself")
        database = urllib.parse.urlsplit(self.redis_url).path.strip("/")
        if self.redis_cluster and database not in ("", "0"):
            raise ValueError(f"redis_cluster: a Redis Cluster has database 0 only, and redis_url names {database}")
        parse_delays(self.webhook_retry_delays)

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """The sentinels as (host, port); empty: no Sentinel, ``redis_url`` names the Redis."""
        return parse_sentinels(self.redis_sentinels)

    @property
    def cluster_addresses(self) -> list[tuple[str, int]]:
        """Some nodes of the Redis Cluster as (host, port); empty: no cluster."""
        return parse_sentinels(self.redis_cluster, "redis_cluster")

    @property
    def wait_replicas(self) -> int:
        """How many replicas WAIT asks for after an acknowledged write (0: no WAIT)."""
        if self.redis_wait_replicas is not None:
            return self.redis_wait_replicas
        return 1 if self.sentinel_addresses or self.cluster_addresses else 0

    def redis_env(self) -> dict[str, str]:
        """The environment that gives a child process (the launcher's worker, a supervised one) the
        Redis of these settings, which command-line flags may have changed."""
        return {"LMSP_REDIS_URL": self.redis_url, "LMSP_REDIS_SENTINELS": self.redis_sentinels,
                "LMSP_REDIS_MASTER": self.redis_master, "LMSP_REDIS_CLUSTER": self.redis_cluster}

    def models_env(self) -> dict[str, str]:
        """The environment that gives a child process the models of these settings that the command
        line named (``model_specs``)."""
        return {"LMSP_MODEL_SPECS": self.model_specs}

    @property
    def principal_rate_limit(self) -> int:
        """Requests per principal and rate window (0: no limit)."""
        return self._per_principal(self.rate_limit, TOKENS_RATE_LIMIT)

    @property
    def principal_max_streams(self) -> int:
        """Open SSE streams per principal (0: no limit)."""
        return self._per_principal(self.max_streams, TOKENS_MAX_STREAMS)

    def _per_principal(self, value: int | None, with_tokens: int) -> int:
        if value is not None:
            return value
        return with_tokens if self.auth == "tokens" else 0

    @property
    def host_is_loopback(self) -> bool:
        """Whether the API's address reaches this machine only: the API and ``lmsp up`` decide
        whether authentication may be off by it."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False

    @property
    def webhook_retry_schedule(self) -> list[float]:
        """The seconds before each retry of a failed webhook delivery (``webhook_retry_delays``)."""
        return parse_delays(self.webhook_retry_delays)

    @property
    def cors_origin_list(self) -> list[str]:
        return [origin.strip() for origin in self.cors_origins.split(",") if origin.strip()]

    def replace(self, **changes: Any) -> "Settings":
        return msgspec.structs.replace(self, **{k: v for k, v in changes.items() if v is not None})


def parse_sentinels(text: str, setting: str = "redis_sentinels") -> list[tuple[str, int]]:
    """``host:port,host:port`` as (host, port) pairs; raises ValueError for anything else."""
    addresses = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{setting}: {entry!r} is not host:port")
        addresses.append((host.removeprefix("[").removesuffix("]"), int(port)))
    return addresses


def parse_delays(text: str) -> list[float]:
    """``5,300,1800`` as seconds; empty: no retry. Raises ValueError for anything else."""
    delays = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        try:
            delay = float(entry)
        except ValueError:
            delay = -1.0
        if not 0 < delay <= 7 * 86400:
            raise ValueError(f"webhook_retry_delays: {entry!r} is not a number of seconds (0 < s <= 604800)")
        delays.append(delay)
    return delays


def load_settings(environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from ``LMSP_*`` environment variables, then ``overrides`` (None means unset)."""
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    for name in Settings.__struct_fields__:
        value = env.get(f"LMSP_{name.upper()}")
        if value is not None:
            raw[name] = value
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return msgspec.convert(raw, Settings, strict=False)
