"""lmsp_core.tracing: W3C trace context, when tracing is on, that nothing of OpenTelemetry is loaded
when it is off, and a run's spans as a real OTLP receiver (``tests.otlp``) gets them."""

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from lmsp_core import tracing
from tests.otlp import OtlpReceiver, ReceivedSpan
from tests.support import ROOT

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.parametrize(("header", "parsed"), [
    (f"00-{TRACE}-{PARENT}-01", f"00-{TRACE}-{PARENT}-01"),
    (f" 00-{TRACE}-{PARENT}-00 ", f"00-{TRACE}-{PARENT}-00"),
    (f"01-{TRACE}-{PARENT}-01-later-fields", f"00-{TRACE}-{PARENT}-01"),  # a later version: its first fields
    (f"00-{TRACE}-{PARENT}-01-more", None),  # version 00 has four fields
    (f"ff-{TRACE}-{PARENT}-01", None),
    (f"00-{'0' * 32}-{PARENT}-01", None),
    (f"00-{TRACE}-{'0' * 16}-01", None),
    (f"00-{TRACE.upper()}-{PARENT}-01", None),
    (f"00-{TRACE[:-1]}-{PARENT}-01", None),
    ("", None), (None, None), ("garbage", None),
])
def test_traceparent_headers_are_read_as_w3c_says(header: str | None, parsed: str | None) -> None:
    assert tracing.parse_traceparent(header) == parsed


def test_the_standard_variables_turn_tracing_on() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": ""})  # compose.yaml's default


def test_off_nothing_of_opentelemetry_is_imported() -> None:
    """The API and a worker, their modules and the spans they make with tracing off: neither the SDK,
    nor the API's tracer, nor an exporter or protobuf is ever loaded (a fresh interpreter, the variables
    unset). Litestar itself imports the ``opentelemetry`` namespace and its HTTP attribute names when the
    package is installed (its check for its own plugin, once, at the app's construction): only those."""
    code = f"""
import sys
from api.http.app import create_app
from lmsp_core import tracing
from lmsp_core.settings import load_settings
import workers.main, workers.service, workers.taskrun, api.http.tracing
import api.background.webhooks.sender, api.background.batchdriver
create_app(load_settings({{}}))
assert not tracing.setup("lmsp-api") and not tracing.enabled()
span = tracing.start("x", "00-{TRACE}-{PARENT}-01")
with tracing.active(span):
    tracing.current().set({{"gen_ai.request.model": "m"}})
span.end()
assert span.traceparent == "00-{TRACE}-{PARENT}-01" and not span.recording
loaded = [name for name in sys.modules if name.split(".")[0] == "opentelemetry" or name.startswith("google.protobuf")]
print(" ".join(loaded))
"""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "LMSP_"))}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert all(name == "opentelemetry" or name.startswith("opentelemetry.semconv") for name in loaded), loaded


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as otlp:
        for name, value in {**otlp.env("lmsp-test"), "OTEL_TRACES_SAMPLER": "parentbased_always_on"}.items():
            monkeypatch.setenv(name, value)
        assert tracing.setup("lmsp-worker")
        try:
            yield otlp
        finally:
            tracing.shutdown()  # sends what is buffered


def test_a_run_traced_as_a_worker_does(receiver: OtlpReceiver) -> None:
    client = f"00-{TRACE}-{PARENT}-01"
    run = tracing.RunTrace(client, model="m", task_id="task_1", response_id="resp_1", attempt=1, worker="w-1",
                           created_at=1_000.0, claimed_at=1_002.5)
    run.prefill(input_tokens=7, resumed_tokens=0)
    run.first_token()
    run.generation_ended("length")
    run.close("incomplete", output_tokens=5, cached_tokens=3)
    tracing.shutdown()
    spans = {span.name: span for span in receiver.of_trace(TRACE)}
    assert set(spans) == {"queue wait", "chat m", "prefill", "decode", "end"}
    chat = spans["chat m"]
    assert chat.service == "lmsp-test" and chat.parent_id == PARENT and chat.kind == 5  # consumer
    assert chat.attributes.items() >= {
        "gen_ai.request.model": "m", "gen_ai.response.id": "resp_1", "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 5, "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.operation.name": "chat", "gen_ai.usage.cache_read.input_tokens": 3, "lmsp.task.attempt": 1,
        "lmsp.task.resumed": False}.items()
    queued = spans["queue wait"]
    assert queued.parent_id == PARENT and (queued.start_ns, queued.end_ns) == (1_000 * 10**9, 1_002_500_000_000)
    phases: list[ReceivedSpan] = [spans[name] for name in ("prefill", "decode", "end")]
    assert all(span.parent_id == chat.span_id for span in phases)
    assert phases[0].end_ns <= phases[1].start_ns and phases[1].end_ns <= phases[2].start_ns
    assert chat.status == 0


def test_a_span_hands_its_own_context_on(receiver: OtlpReceiver) -> None:
    span = tracing.start("POST /lmsp/v1/tasks", f"00-{TRACE}-{PARENT}-01", kind="server")
    assert span.recording and span.traceparent is not None
    _, trace_id, span_id, flags = span.traceparent.split("-")
    assert trace_id == TRACE and span_id != PARENT and flags == "01"
    child = tracing.start("child", span.traceparent)
    child.fail("broken")
    child.end()
    span.end()
    unsampled = tracing.start("not sampled", f"00-{TRACE}-{PARENT}-00")  # the client did not sample it
    assert not unsampled.recording and unsampled.traceparent == f"00-{TRACE}-{unsampled.traceparent[36:52]}-00"
    unsampled.end()
    tracing.shutdown()
    spans = {span.name: span for span in receiver.of_trace(TRACE)}
    assert set(spans) == {"POST /lmsp/v1/tasks", "child"}
    assert spans["child"].parent_id == span_id and spans["child"].status == 2
