"""What ``/metrics`` and ``/status`` report: the service's state read from Redis, plus this process.

Service-wide numbers (queues, workers, tasks, tokens, latencies) come from Redis, so every API
process reports the same values for them and one scrape sees the whole service (see
``lmsp_core.store.metrics`` for how workers add theirs). Only ``lmsp_open_streams`` belongs to the
process that answers the scrape. With several API replicas, scrape any one for the service-wide
series, or aggregate them with ``max``; sum ``lmsp_open_streams`` over replicas.

Per-principal series (``lmsp_principal_*``, and ``principals`` of ``/status``) are capped per model:
see ``principal_rows``.
"""

import asyncio
from collections import Counter, defaultdict
from collections.abc import Iterator

import msgspec
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from lmsp_core.requests.catalog import Catalog
from lmsp_core.settings import Settings
from lmsp_core.store import keys, metrics, registry
from lmsp_core.store.tasks.fairqueue import FairQueue, Share
from lmsp_core.store.tenants import principals

PREFIX = "lmsp_"
# the principals of a model beyond the cap, summed into one row ('~' never occurs in a principal's name)
OTHER = "~other"


class ModelState(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    status: str
    workers: int
    queued: int
    running: int
    slots: int = 0  # KV slots of the live workers' engines
    slots_used: int = 0  # ... held by sequences


class WorkerState(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    host: str
    device: str
    models: list[str]
    state: str  # warming (loading, compiling) or ready
    running: int
    started_at: int


class PrincipalState(msgspec.Struct, frozen=True, kw_only=True):
    """One principal's part of one model: its tasks waiting and running in the fair queue, the tokens
    generated for it so far, and its settings (``lmsp principal set``). The row ``~other`` sums the
    principals beyond the cap (``principal_rows``): its weight is the sum of their weights, and it
    has no quotas."""

    model: str
    principal: str
    queued: int
    running: int
    generated_tokens: int
    weight: float
    max_running: int | None
    max_queued: int | None


class ServiceState(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /status``: the queue and the workers, as the playground shows them."""

    models: list[ModelState]
    workers: list[WorkerState]
    principals: list[PrincipalState]


async def service_state(redis: Redis, catalog: Catalog, settings: Settings,
                        stored: dict[metrics.Field, float] | None = None) -> ServiceState:
    """The service's state; ``stored``: the metrics hash when the caller has read it already."""
    workers = await registry.live_workers(redis)
    serving = registry.ready_per_model(workers)
    warming = registry.warming_per_model(workers)
    running: Counter[str] = Counter()
    slots: Counter[str] = Counter()
    used: Counter[str] = Counter()
    for info in workers:
        running.update(info.running)
        slots.update(info.slots)
        used.update(info.slots_used)
    models = list(catalog)
    async with redis.pipeline(transaction=False) as pipe:
        for spec in models:
            pipe.zcard(keys.queue(spec.id))
        depths = await pipe.execute()
    if stored is None:
        stored = await metrics.load(redis)
    shares = await FairQueue(redis).shares([spec.id for spec in models]) if settings.fair_share else {}
    rows = principal_rows(shares, _principal_tokens(stored), await principals.load(redis),
                          settings.metrics_principals)
    # an arq job stays in its queue until it finishes: the waiting ones are those not running
    return ServiceState(
        models=[ModelState(id=spec.id, status="available" if serving[spec.id] else
                           "warming" if warming[spec.id] else "unavailable",
                           workers=serving[spec.id], queued=max(0, int(depth) - running[spec.id]),
                           running=running[spec.id], slots=slots[spec.id], slots_used=used[spec.id])
                for spec, depth in zip(models, depths, strict=True)],
        workers=[WorkerState(id=info.id, host=info.host, device=info.device, models=info.models, state=info.state,
                             running=sum(info.running.values()), started_at=int(info.started_at))
                 for info in workers],
        principals=rows,
    )


def _principal_tokens(stored: dict[metrics.Field, float]) -> dict[str, dict[str, int]]:
    """Per model and principal, the ``PRINCIPAL_TOKENS`` counter of the metrics hash."""
    tokens: defaultdict[str, dict[str, int]] = defaultdict(dict)
    for fields, value in stored.items():
        if fields[0] == metrics.PRINCIPAL_TOKENS.name and len(fields) == 4 and value > 0:
            tokens[fields[1]][fields[2]] = int(value)
    return tokens


def principal_rows(shares: dict[str, list[Share]], tokens: dict[str, dict[str, int]],
                   table: dict[str, principals.PrincipalSettings], cap: int) -> list[PrincipalState]:
    """The per-principal rows of ``/status`` and series of ``/metrics``, at most ``cap`` named
    principals per model (``LMSP_METRICS_PRINCIPALS``) and one ``~other`` row.

    A model's principals are those with tasks queued or running (its fair queue; with
    ``LMSP_FAIR_SHARE`` off nothing is counted there) or with tokens generated. They are ranked by
    running + queued tasks, then generated tokens, both descending, then by name; the first ``cap``
    keep their own row and the rest are summed into one row, ``principal="~other"`` (present only
    when there is a rest). So the principals loading a model now are named first, then the heaviest
    users so far.

    Cardinality: principal names come only from the bearer tokens an operator created (``lmsp
    token``), or are the single ``local`` of ``LMSP_AUTH=none``, never from request bodies; that is
    the first bound. The cap is the second: at most ``cap + 1`` principals per model, whatever the
    number of tokens. The price of the cap: a principal's counter series (generated tokens) exists
    only while it ranks in the first ``cap``; when it drops out, its series ends and ``~other``
    jumps by its total, and when it comes back ``~other`` falls by it (a counter reset to
    Prometheus). ``rate()`` of those series is wrong around such a move; their sum per model is
    not. Raise ``LMSP_METRICS_PRINCIPALS`` above the number of principals for exact series.

    Rows are sorted by model, then running + queued descending, then name.
    """
    rows: list[PrincipalState] = []
    for model in sorted(set(shares) | set(tokens)):
        now = {share.principal: share for share in shares.get(model, [])}
        made = tokens.get(model, {})
        every = [_row(model, name, now.get(name), made.get(name, 0), table.get(name, principals.DEFAULT))
                 for name in set(now) | set(made)]
        every.sort(key=lambda row: (-(row.running + row.queued), -row.generated_tokens, row.principal))
        kept, rest = every[:cap], every[cap:]
        if rest:
            kept.append(PrincipalState(
                model=model, principal=OTHER, queued=sum(row.queued for row in rest),
                running=sum(row.running for row in rest),
                generated_tokens=sum(row.generated_tokens for row in rest),
                weight=sum(row.weight for row in rest), max_running=None, max_queued=None))
        rows.extend(sorted(kept, key=lambda row: (-(row.running + row.queued), row.principal)))
    return rows


def _row(model: str, name: str, share: Share | None, tokens: int,
         settings: principals.PrincipalSettings) -> PrincipalState:
    return PrincipalState(model=model, principal=name, queued=share.queued if share else 0,
                          running=share.running if share else 0, generated_tokens=tokens,
                          weight=settings.weight, max_running=settings.max_running,
                          max_queued=settings.max_queued)


class _Snapshot(Collector):
    """Yields the families built from the last read of Redis (collect() cannot await)."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.open_streams = Gauge(PREFIX + "open_streams", "SSE streams this API process is sending now.",
                                  ["kind"], registry=self.registry)
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        self._lock = asyncio.Lock()

    async def render(self, redis: Redis, catalog: Catalog, settings: Settings) -> bytes:
        """The service-wide series read from Redis; with Redis unreachable, only this process's and
        ``lmsp_redis_up 0`` (the alert rules' "Redis away")."""
        try:
            stored = await metrics.load(redis)
            state = await service_state(redis, catalog, settings, stored)
        except (RedisError, OSError):
            families = [_redis_up(False)]
        else:
            families = [_redis_up(True), *_state_families(state), *_stored_families(stored)]
        async with self._lock:
            self._snapshot.families = families
            return generate_latest(self.registry)


def _redis_up(up: bool) -> Metric:
    return GaugeMetricFamily(PREFIX + "redis_up", "1 when this API process read the service's state from Redis for "
                             "this scrape, 0 when Redis was unreachable.", value=1 if up else 0)


def _state_families(state: ServiceState) -> list[Metric]:
    depth = GaugeMetricFamily(PREFIX + "queue_depth", "Tasks waiting in a model's queue.", labels=["model"])
    tasks = GaugeMetricFamily(PREFIX + "tasks", "Tasks not final yet, by status.", labels=["model", "status"])
    workers = GaugeMetricFamily(PREFIX + "model_workers", "Live workers serving a model.", labels=["model"])
    for model in state.models:
        depth.add_metric([model.id], model.queued)
        tasks.add_metric([model.id, "queued"], model.queued)
        tasks.add_metric([model.id, "in_progress"], model.running)
        workers.add_metric([model.id], model.workers)
    alive = GaugeMetricFamily(PREFIX + "workers_alive", "Worker processes with a live heartbeat.",
                              value=len(state.workers))
    return [depth, tasks, workers, alive, *_engine_families(state.models), *_principal_families(state.principals)]


def _engine_families(models: list[ModelState]) -> list[Metric]:
    """vLLM's gauges of a model's requests and KV cache, summed over its live workers (as of their
    last heartbeats)."""
    running = GaugeMetricFamily(PREFIX + "requests_running", "Tasks a worker runs now.", labels=["model"])
    waiting = GaugeMetricFamily(PREFIX + "requests_waiting", "Tasks waiting in the queue for a worker.",
                                labels=["model"])
    slots = GaugeMetricFamily(PREFIX + "kv_slots", "KV cache slots (one sequence each) of the live workers.",
                              labels=["model"])
    used = GaugeMetricFamily(PREFIX + "kv_slots_used", "KV cache slots held by a sequence.", labels=["model"])
    usage = GaugeMetricFamily(PREFIX + "kv_slots_usage", "Share of the KV cache slots held (0 to 1).",
                              labels=["model"])
    for model in models:
        running.add_metric([model.id], model.running)
        waiting.add_metric([model.id], model.queued)
        slots.add_metric([model.id], model.slots)
        used.add_metric([model.id], model.slots_used)
        usage.add_metric([model.id], model.slots_used / model.slots if model.slots else 0.0)
    return [running, waiting, slots, used, usage]


def _principal_families(rows: list[PrincipalState]) -> list[Metric]:
    """The capped per-principal series (``principal_rows``), in place of the raw counter."""
    capped = f"the {OTHER} series sums the principals beyond a model's first LMSP_METRICS_PRINCIPALS."
    tasks = GaugeMetricFamily(PREFIX + "principal_tasks", "A principal's tasks in a model's fair queue, by status "
                              f"(queued, running); {capped}", labels=["model", "principal", "status"])
    tokens = CounterMetricFamily(PREFIX + metrics.PRINCIPAL_TOKENS.name, "Tokens generated for a principal's "
                                 f"tasks; {capped}", labels=list(metrics.PRINCIPAL_TOKENS.labels))
    for row in rows:
        tasks.add_metric([row.model, row.principal, "queued"], row.queued)
        tasks.add_metric([row.model, row.principal, "running"], row.running)
        tokens.add_metric([row.model, row.principal], row.generated_tokens)
    return [tasks, tokens]


def _stored_families(stored: dict[metrics.Field, float]) -> list[Metric]:
    families: list[Metric] = []
    for counter in metrics.COUNTERS:
        if counter is metrics.PRINCIPAL_TOKENS:
            continue  # one series per principal: capped, from the service state (_principal_families)
        family = CounterMetricFamily(PREFIX + counter.name, counter.help, labels=list(counter.labels))
        for fields, value in sorted(stored.items()):
            if fields[0] == counter.name and len(fields) == len(counter.labels) + 2:
                family.add_metric(list(fields[1:-1]), value)
        families.append(family)
    for histogram in metrics.HISTOGRAMS:
        families.append(_histogram(histogram, stored))
    return families


def _histogram(histogram: metrics.Histogram, stored: dict[metrics.Field, float]) -> Metric:
    parts: defaultdict[tuple[str, ...], dict[str, float]] = defaultdict(dict)
    width = len(histogram.labels)
    for fields, value in stored.items():
        if fields[0] == histogram.name and len(fields) == width + 2:
            parts[fields[1:-1]][fields[-1]] = value
    family = HistogramMetricFamily(PREFIX + histogram.name, histogram.help, labels=list(histogram.labels))
    for labels, values in sorted(parts.items()):
        cumulative = 0.0
        buckets: list[tuple[str, float]] = []
        for bound in histogram.buckets:
            cumulative += values.get(repr(float(bound)), 0.0)
            buckets.append((_bound(bound), cumulative))
        buckets.append(("+Inf", cumulative + values.get("+Inf", 0.0)))
        family.add_metric(list(labels), buckets, sum_value=values.get("sum", 0.0))
    return family


def _bound(value: float) -> str:
    return repr(float(value))
