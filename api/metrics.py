"""What ``/metrics`` and ``/status`` report: the service's state read from Redis, plus this process.

Service-wide numbers (queues, workers, tasks, tokens, latencies) come from Redis, so every API
process reports the same values for them and one scrape sees the whole service (see
``lmsp_core.store.metrics`` for how workers add theirs). Only ``lmsp_open_streams`` belongs to the
process that answers the scrape. With several API replicas, scrape any one for the service-wide
series, or aggregate them with ``max``; sum ``lmsp_open_streams`` over replicas.
"""

import asyncio
from collections import Counter, defaultdict
from collections.abc import Iterator

import msgspec
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from lmsp_core.requests.catalog import Catalog
from lmsp_core.store import keys, metrics, registry

PREFIX = "lmsp_"


class ModelState(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    status: str
    workers: int
    queued: int
    running: int


class WorkerState(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    host: str
    device: str
    models: list[str]
    state: str  # warming (loading, compiling) or ready
    running: int
    started_at: int


class ServiceState(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /status``: the queue and the workers, as the playground shows them."""

    models: list[ModelState]
    workers: list[WorkerState]


async def service_state(redis: Redis, catalog: Catalog) -> ServiceState:
    workers = await registry.live_workers(redis)
    serving = registry.ready_per_model(workers)
    warming = registry.warming_per_model(workers)
    running: Counter[str] = Counter()
    for info in workers:
        running.update(info.running)
    models = list(catalog)
    async with redis.pipeline(transaction=False) as pipe:
        for spec in models:
            pipe.zcard(keys.queue(spec.id))
        depths = await pipe.execute()
    # an arq job stays in its queue until it finishes: the waiting ones are those not running
    return ServiceState(
        models=[ModelState(id=spec.id, status="available" if serving[spec.id] else
                           "warming" if warming[spec.id] else "unavailable",
                           workers=serving[spec.id], queued=max(0, int(depth) - running[spec.id]),
                           running=running[spec.id]) for spec, depth in zip(models, depths, strict=True)],
        workers=[WorkerState(id=info.id, host=info.host, device=info.device, models=info.models, state=info.state,
                             running=sum(info.running.values()), started_at=int(info.started_at))
                 for info in workers],
    )


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

    async def render(self, redis: Redis, catalog: Catalog) -> bytes:
        state = await service_state(redis, catalog)
        stored = await metrics.load(redis)
        async with self._lock:
            self._snapshot.families = [*_state_families(state), *_stored_families(stored)]
            return generate_latest(self.registry)


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
    return [depth, tasks, workers, alive]


def _stored_families(stored: dict[metrics.Field, float]) -> list[Metric]:
    families: list[Metric] = []
    for counter in metrics.COUNTERS:
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
