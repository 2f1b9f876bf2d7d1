"""Service-wide metrics kept in Redis, so that one scrape of any API process sees the whole service.

Tokens are only seen by workers, HTTP streams and queues by API processes. Workers therefore
accumulate counters and histogram buckets in memory (a dict increment and a bisect per token) and
add the deltas to one Redis hash (``keys.metrics()``) with ``HINCRBY`` in the pipeline of the
heartbeat they send anyway, every ``LMSP_WORKER_HEARTBEAT`` seconds: no Redis round trip is tied
to a token. API processes add their own few counts (tasks created, queued tasks cancelled) the
same way, and export the hash at ``/metrics`` (``api/metrics.py``). The sums are cumulative over
the life of the Redis data, so they do not reset when a worker restarts; a worker that dies loses
at most its last unflushed interval.

A field of the hash is the JSON list ``[metric, label values..., part]`` where ``part`` is ``""``
for a counter, ``"sum"`` and ``"count"`` of a histogram, or a bucket's upper bound (counts per
bucket, not cumulative: the exporter adds them up).
"""

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from lmsp_core.store import keys


@dataclass(frozen=True)
class Histogram:
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...]


@dataclass(frozen=True)
class Counter:
    name: str
    help: str
    labels: tuple[str, ...]


QUEUE_TIME = Histogram("queue_time_seconds", "Time from a task's creation until a worker first claims it.",
                       ("model",), (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600))
TTFT = Histogram("time_to_first_token_seconds", "Time from a task's creation (queue wait included) to its first "
                 "generated token.", ("model",), (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))
ITL = Histogram("inter_token_latency_seconds", "Time between two consecutive tokens of one generation.",
                ("model",), (0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5))
TOKENS = Counter("generated_tokens", "Tokens generated (rate() of it is the service's tokens/s).", ("model",))
PRINCIPAL_TOKENS = Counter("principal_generated_tokens", "Tokens generated for a principal's tasks.",
                           ("model", "principal"))
CREATED = Counter("tasks_created", "Generation tasks accepted (kind: task or direct response).", ("model", "kind"))
FINISHED = Counter("tasks_finished", "Generation tasks that reached a final status.", ("model", "status"))
# the names beside vLLM's and OpenTelemetry's GenAI ones: docs/observability.md
_LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
E2E = Histogram("e2e_request_latency_seconds", "Time from a task's creation to its final event stored (a task "
                "cancelled while queued is not counted).", ("model",), _LATENCY)
PREFILL = Histogram("request_prefill_time_seconds", "Time from a run handing its context to the engine to its first "
                    "token (a resumed run's context holds the tokens generated before).", ("model",),
                    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
DECODE = Histogram("request_decode_time_seconds", "Time from a run's first token to its last.", ("model",), _LATENCY)
TPOT = Histogram("time_per_output_token_seconds", "A run's decode time divided by its tokens after the first.",
                 ("model",), ITL.buckets)
BATCH_SIZE = Histogram("step_batch_size", "Sequences in one engine step (decoding and prefilling).", ("model",),
                       (1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
PROMPT_TOKENS = Counter("prompt_tokens", "Prompt tokens of the tasks started (counted at a task's first run).",
                        ("model",))
RECLAIMS = Counter("task_reclaims", "Claims of a task that an earlier run had claimed (its worker died, or handed "
                   "it back).", ("model",))
RESUMES = Counter("task_resumes", "Runs that resumed a task from the tokens an earlier run stored.", ("model",))

HISTOGRAMS = (QUEUE_TIME, TTFT, ITL, E2E, PREFILL, DECODE, TPOT, BATCH_SIZE)
COUNTERS = (TOKENS, PRINCIPAL_TOKENS, CREATED, FINISHED, PROMPT_TOKENS, RECLAIMS, RESUMES)

Field = tuple[str, ...]


def field(metric: str, labels: tuple[str, ...], part: str = "") -> bytes:
    return msgspec.json.encode([metric, *labels, part])


def parse_field(raw: bytes) -> Field | None:
    try:
        decoded = msgspec.json.decode(raw, type=list[str])
    except msgspec.DecodeError:
        return None
    return tuple(decoded)


class Recorder:
    """Deltas since the last flush. Not thread-safe: used from one event loop."""

    def __init__(self) -> None:
        self._counts: defaultdict[bytes, int] = defaultdict(int)
        self._sums: defaultdict[bytes, float] = defaultdict(float)

    def count(self, counter: Counter, labels: tuple[str, ...], n: int = 1) -> None:
        self._counts[field(counter.name, labels)] += n

    def observe(self, histogram: Histogram, labels: tuple[str, ...], value: float, n: int = 1) -> None:
        """``n`` observations of ``value``."""
        self.series(histogram, labels).observe(value, n)

    def series(self, histogram: Histogram, labels: tuple[str, ...]) -> "Series":
        """One labelled series of ``histogram``, its fields made once (a meter observes every token)."""
        return Series(self, histogram, labels)

    def meter(self, model: str, principal: str, created_at: float, resumed: bool) -> "TokenMeter":
        return TokenMeter(self, model, principal, created_at, resumed)

    def take(self) -> tuple[dict[bytes, int], dict[bytes, float]]:
        counts, sums = dict(self._counts), dict(self._sums)
        self._counts.clear()
        self._sums.clear()
        return counts, sums

    def restore(self, taken: tuple[dict[bytes, int], dict[bytes, float]]) -> None:
        """Put back deltas whose flush failed, so that they go out with the next one."""
        for name, n in taken[0].items():
            self._counts[name] += n
        for name, value in taken[1].items():
            self._sums[name] += value

    def add_to(self, pipe: Pipeline) -> tuple[dict[bytes, int], dict[bytes, float]]:
        """Queue the pending deltas on ``pipe``; returns them for ``restore`` if it fails."""
        taken = self.take()
        for name, n in taken[0].items():
            pipe.hincrby(keys.metrics(), name, n)  # type: ignore[arg-type]
        for name, value in taken[1].items():
            pipe.hincrbyfloat(keys.metrics(), name, value)  # type: ignore[arg-type]
        return taken

    async def flush(self, redis: Redis) -> None:
        async with redis.pipeline(transaction=False) as pipe:
            taken = self.add_to(pipe)
            if not (taken[0] or taken[1]):
                return
            try:
                await pipe.execute()
            except BaseException:
                self.restore(taken)
                raise


class Series:
    """A histogram's series of one set of labels, observed into a ``Recorder``."""

    __slots__ = ("_buckets", "_count", "_fields", "_recorder", "_sum")

    def __init__(self, recorder: Recorder, histogram: Histogram, labels: tuple[str, ...]) -> None:
        self._recorder = recorder
        self._buckets = histogram.buckets
        bounds = [repr(float(bound)) for bound in histogram.buckets] + ["+Inf"]
        self._fields = [field(histogram.name, labels, bound) for bound in bounds]
        self._count = field(histogram.name, labels, "count")
        self._sum = field(histogram.name, labels, "sum")

    def observe(self, value: float, n: int = 1) -> None:
        counts = self._recorder._counts
        counts[self._fields[bisect.bisect_left(self._buckets, value)]] += n
        counts[self._count] += n
        self._recorder._sums[self._sum] += value * n


class TokenMeter:
    """The per-token measurements of one generation: count (the model's and its principal's), time
    to first token, inter-token gaps; and, when it ends, its prefill and decode times (``ended``)."""

    __slots__ = ("_count", "_created_at", "_first", "_itl", "_labels", "_last", "_principal_count", "_recorder",
                 "_resumed", "_started", "tokens")

    def __init__(self, recorder: Recorder, model: str, principal: str, created_at: float, resumed: bool) -> None:
        self._recorder = recorder
        self._labels = (model,)
        self._count = field(TOKENS.name, self._labels)
        self._principal_count = field(PRINCIPAL_TOKENS.name, (model, principal))
        self._itl = recorder.series(ITL, self._labels)
        self._created_at = created_at
        self._resumed = resumed  # a resumed task's first token is not its first
        self._started = time.monotonic()  # the context went to the engine
        self._first: float | None = None
        self._last: float | None = None
        self.tokens = 0  # generated by this run

    def token(self) -> None:
        now = time.monotonic()
        recorder = self._recorder
        recorder._counts[self._count] += 1
        recorder._counts[self._principal_count] += 1
        self.tokens += 1
        if self._last is not None:
            self._itl.observe(now - self._last)
        else:
            self._first = now
            if not self._resumed:
                # created_at is the API host's wall clock: a cross-host measurement, like queue time
                recorder.observe(TTFT, self._labels, max(0.0, time.time() - self._created_at))
        self._last = now

    def ended(self) -> None:
        """The generation ended: its prefill time, and its decode time (in all and per token)."""
        if self._first is None or self._last is None:
            return
        recorder = self._recorder
        recorder.observe(PREFILL, self._labels, self._first - self._started)
        recorder.observe(DECODE, self._labels, self._last - self._first)
        if self.tokens > 1:
            recorder.observe(TPOT, self._labels, (self._last - self._first) / (self.tokens - 1))


async def add_now(redis: Redis, counter: Counter, labels: tuple[str, ...], n: int = 1) -> None:
    """One count straight into Redis, for events rarer than tokens (a task created or cancelled)."""
    await redis.hincrby(keys.metrics(), field(counter.name, labels), n)  # type: ignore[misc, arg-type]


async def load(redis: Redis) -> dict[Field, float]:
    raw = await redis.hgetall(keys.metrics())  # type: ignore[misc]
    values: dict[Field, float] = {}
    for name, value in raw.items():
        parsed = parse_field(name)
        if parsed is not None:
            values[parsed] = float(value)
    return values
