"""A real OTLP/HTTP receiver for the tests: it decodes what exporters POST to ``/v1/traces``
(``ExportTraceServiceRequest``, protobuf, gzip or not) with OpenTelemetry's own protobuf package and
keeps the spans, as a collector would take them in."""

import gzip
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from lmsp_core.ports import free_port


class ReceivedSpan(msgspec.Struct, frozen=True):
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {item.key: _value(item.value) for item in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    service=str(resource.get("service.name", "")), trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(), name=span.name,
                    kind=span.kind, start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                    attributes={item.key: _value(item.value) for item in span.attributes}, status=span.status.code))
    return spans


class OtlpReceiver:
    """``with OtlpReceiver() as receiver``: listening on a free loopback port until the block ends."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, service: str) -> dict[str, str]:
        """What a process needs to export its spans here at once (the batch's delay shortened)."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_SERVICE_NAME": service,
                "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait(self, check: Callable[[list[ReceivedSpan]], bool], trace_id: str,
             timeout: float = 60) -> list[ReceivedSpan]:
        """The spans of ``trace_id`` once ``check`` holds for them (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.of_trace(trace_id)
            if check(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((span.service, span.name) for span in spans)
                raise AssertionError(f"the spans of trace {trace_id} never met the check: {names}")
            time.sleep(0.1)
