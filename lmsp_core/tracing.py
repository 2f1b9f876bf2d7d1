"""Traces over OTLP (OpenTelemetry), for the API and the workers: one home for the spans we make.

Off unless the standard variables ask for it: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT`` set (and neither ``OTEL_SDK_DISABLED=true`` nor
``OTEL_TRACES_EXPORTER=none``). Off, the OpenTelemetry packages are never imported and a span is
``NOOP``, which only carries its parent's ``traceparent`` along: a client's W3C trace context still
travels with its task through Redis, so a worker that traces joins the client's trace even when the
API does not. On, the SDK does what its variables say (``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``
and ``_ARG``, ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf`` by default, ``grpc`` where that
exporter is installed, ``OTEL_BSP_*``, ``OTEL_RESOURCE_ATTRIBUTES``).

Parents are passed explicitly as ``traceparent`` strings, never through OpenTelemetry's ambient
context: a task's trace context is a field of its record (and a batch's, a webhook delivery's), and
the spans of a task's run are started from it on whichever worker claims the task, after another died
too. Spans carry OpenTelemetry's GenAI attributes (``gen_ai.*``: model, token counts, response id,
finish reasons), never prompts or outputs (docs/observability.md).
"""

import contextlib
import contextvars
import importlib
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# W3C Trace Context: version, trace id, parent id, flags; a later version may append fields after a '-'
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")

Attributes = Mapping[str, str | int | float | bool | Sequence[str]]


def parse_traceparent(header: str | None) -> str | None:
    """The version-00 form of a valid ``traceparent`` header, or None (absent or invalid: the request
    starts a trace of its own, as the W3C specification asks)."""
    if not header:
        return None
    match = _TRACEPARENT.fullmatch(header.strip())
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (see the module's text)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class Span:
    """A span that records nothing (tracing off, or not set up): it hands on its parent's context."""

    __slots__ = ("traceparent",)

    def __init__(self, traceparent: str | None) -> None:
        self.traceparent = traceparent

    @property
    def recording(self) -> bool:
        return False

    def set(self, attributes: Attributes) -> None:
        pass

    def fail(self, description: str) -> None:
        pass

    def end(self, at: float | None = None) -> None:
        pass


NOOP = Span(None)


class _Recorded(Span):
    __slots__ = ("_span",)

    def __init__(self, span: "OtelSpan", traceparent: str | None) -> None:
        super().__init__(traceparent)
        self._span = span

    @property
    def recording(self) -> bool:
        return self._span.is_recording()

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def fail(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description))

    def end(self, at: float | None = None) -> None:
        self._span.end(None if at is None else _ns(at))


class _Tracing:
    """The process's tracer, once ``setup`` found tracing wanted."""

    def __init__(self) -> None:
        self.tracer: Tracer | None = None
        self.shutdown: Any = None  # the provider's shutdown
        self.extract: Any = None  # the W3C propagator's: a carrier to a context

    def start(self, name: str, parent: str | None, kind: str, attributes: Attributes | None,
              at: float | None) -> Span:
        assert self.tracer is not None
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(name, context=self.extract({TRACEPARENT: parent}) if parent else None,
                                      kind=SpanKind[kind.upper()], attributes=attributes,
                                      start_time=None if at is None else _ns(at))
        context = span.get_span_context()
        return _Recorded(span, f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}")


_state = _Tracing()
_current: contextvars.ContextVar[Span] = contextvars.ContextVar("lmsp_span", default=NOOP)


def setup(default_service: str) -> bool:
    """Start exporting spans when the environment asks for it (once a process); returns whether it
    does. ``default_service``: ``service.name`` unless ``OTEL_SERVICE_NAME`` names one. The SDK reads
    the rest of its variables from the environment itself."""
    env = os.environ
    if _state.tracer is not None or not wanted(env):
        return _state.tracer is not None
    exporter = _exporter(env)
    if exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    version = _version()
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or default_service,
                                "service.version": version, "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)  # its sampler: OTEL_TRACES_SAMPLER (parent-based by default)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _state.tracer = provider.get_tracer("lmsp", version)
    _state.shutdown = provider.shutdown
    _state.extract = TraceContextTextMapPropagator().extract
    logger.info("tracing: exporting spans over OTLP as %s", resource.attributes.get("service.name"))
    return True


# the exporter of each OTLP protocol (grpc's is not installed with the service: pip install it to use it)
_EXPORTERS = {"http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
              "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"}


def _exporter(env: Mapping[str, str]) -> Any:
    """The OTLP exporter of ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``; it reads its endpoint, headers
    and timeout from the environment itself. None: that protocol cannot be exported here."""
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol not in _EXPORTERS:
        logger.error("tracing off: OTLP protocol %r is not supported (%s)", protocol, " or ".join(_EXPORTERS))
        return None
    try:
        module = importlib.import_module(_EXPORTERS[protocol])
    except ImportError as exc:
        logger.error("tracing off: the OTLP exporter for %s is not installed (%s)", protocol, exc.name)
        return None
    return module.OTLPSpanExporter()


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("lmsp-service")
    except metadata.PackageNotFoundError:
        return "0"


def enabled() -> bool:
    return _state.tracer is not None


def shutdown() -> None:
    """Send what is buffered and stop (a process that ends; the SDK also does it at exit)."""
    if _state.shutdown is not None:
        _state.shutdown()
        _state.tracer = None
        _state.shutdown = None


def start(name: str, parent: str | None, *, kind: str = "internal",
          attributes: Attributes | None = None, at: float | None = None) -> Span:
    """A span, child of ``parent`` (a ``traceparent``; None: a new trace); ``at``: its start, in
    seconds since the epoch (default: now). Off: a span that records nothing and passes ``parent`` on."""
    if _state.tracer is None:
        return Span(parent)
    return _state.start(name, parent, kind, attributes, at)


def current() -> Span:
    """The span this task (asyncio's) works for: what ``active`` set, else ``NOOP``."""
    return _current.get()


@contextlib.contextmanager
def active(span: Span) -> Iterator[Span]:
    """Make ``span`` the current one while the block runs (the tasks it creates inherit it)."""
    token = _current.set(span)
    try:
        yield span
    finally:
        _current.reset(token)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


# --- a task's run on a worker ----------------------------------------------------------------------

# OpenTelemetry's GenAI conventions: what a run's span says of the generation (never its text)
OPERATION = "chat"
PROVIDER = "lmsp"


class RunTrace:
    """The spans of one run of a task on a worker, in the task's trace (its record's ``trace``):
    ``queue wait`` (from the task's creation to its first claim), the run itself (``chat {model}``,
    with the GenAI attributes) and, inside it, ``prefill`` (handed to the engine until the first
    token), ``decode`` (until the generation ends) and ``end`` (until the final event is stored). A
    run that resumes a task another worker left is a run like the first, ``lmsp.task.resumed``: the
    dead worker's open spans are lost with it, its ended ones were exported."""

    __slots__ = ("_phase", "run")

    def __init__(self, parent: str | None, *, model: str, task_id: str, response_id: str, attempt: int,
                 worker: str, created_at: float, claimed_at: float) -> None:
        common = {"gen_ai.request.model": model, "lmsp.task.id": task_id}
        if attempt == 1:
            start("queue wait", parent, kind="consumer", attributes=common, at=created_at).end(claimed_at)
        self.run = start(f"{OPERATION} {model}", parent, kind="consumer", at=claimed_at, attributes={
            **common, "gen_ai.operation.name": OPERATION, "gen_ai.provider.name": PROVIDER,
            "gen_ai.system": PROVIDER, "gen_ai.response.id": response_id, "gen_ai.response.model": model,
            "lmsp.task.attempt": attempt, "lmsp.worker.id": worker})
        self._phase: Span = NOOP

    def prefill(self, input_tokens: int, resumed_tokens: int) -> None:
        """The run hands its context to the engine (``resumed_tokens``: generated by earlier runs)."""
        self.run.set({"gen_ai.usage.input_tokens": input_tokens, "lmsp.task.resumed": resumed_tokens > 0,
                      "lmsp.task.resumed_tokens": resumed_tokens})
        self._next("prefill")

    def first_token(self) -> None:
        self._next("decode")

    def generation_ended(self, reason: str) -> None:
        self.run.set({"gen_ai.response.finish_reasons": [reason]})
        self._next("end")

    def close(self, outcome: str, output_tokens: int, cached_tokens: int = 0) -> None:
        """The run is over (``outcome``: the task's final status, or why it stopped without one)."""
        self._phase.end()
        self._phase = NOOP
        self.run.set({"gen_ai.usage.output_tokens": output_tokens, "lmsp.task.outcome": outcome,
                      "gen_ai.usage.cache_read.input_tokens": cached_tokens})
        if outcome == "failed":
            self.run.fail("the task failed")
        self.run.end()

    def _next(self, name: str) -> None:
        self._phase.end()
        self._phase = start(name, self.run.traceparent)

