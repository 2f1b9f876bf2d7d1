"""What tracing costs: one stream's tokens/s and time to first token, and the API's and the worker's
CPU a token, with tracing off and on, in the same run.

Starts a fresh stack (``bench.stack.Stack``: redis-server, API, one worker) for every measurement:
tracing off (no ``OTEL_*`` variable: nothing of OpenTelemetry is loaded) and on (the API and the
worker export over OTLP/HTTP to a receiver in this process, which decodes every request and counts its
spans: ``OTEL_EXPORTER_OTLP_ENDPOINT``, the SDK's default batching), the order swapped every round.
A measurement streams one response to warm up, then ``--streams`` responses one after the other, each
of ``--tokens`` tokens and each sent with a client's ``traceparent`` (also with tracing off: the
client is the same), and reads the API's and the worker's CPU time (``/proc``) around them. Prints
the medians of ``--rounds`` rounds, on against off.

On a shared machine those CPU figures move by more than tracing could cost: so the command also
measures the spans themselves, in a process of their own (``--span-cost``) that makes ``--span-tasks``
tasks' spans as the API and a worker do (the request's span, queue wait, the run, prefill, decode,
end) with the SDK exporting them to the receiver; its CPU time a task, over the tokens of a stream,
against the CPU a token of the stack with tracing off, is tracing's share a token.

    python -m bench.tracing [--model smollm2:135m-instruct] [--tokens 128] [--streams 8] [--rounds 3]
                            [--json FILE]
    python -m bench.tracing --quick: a smoke test (tiny-random, one round of two streams)

Every figure shares this machine's cores with the client and the other processes: compare on with
off within a round (the JSON keeps every round), not across runs.
"""

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec

from bench.fairshare import host, rounded
from bench.report import Table, prompt_text, ratio, user_input
from bench.sse import HOST, SseStream
from bench.stack import Stack, cpu_seconds
from lmsp_core import tracing, wire
from lmsp_core.ports import free_port
from lmsp_core.requests.catalog import Catalog
from lmsp_core.settings import load_settings

MODES = ("off", "on")


class SpanSink:
    """An OTLP/HTTP receiver that counts the spans it is sent (``ExportTraceServiceRequest``)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        self.port = free_port()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                sink.spans += sum(len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Run:
    """One measurement: tracing ``mode``, its streams' figures (medians) and the CPU a token."""

    mode: str
    tokens_per_s: float = 0.0  # one stream's, from its first text to its end
    ttft_ms: float = 0.0
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)  # api, worker
    tokens: int = 0
    spans: int = 0  # what the receiver got (on)
    streams: list[dict[str, float]] = field(default_factory=list)


async def one_stream(port: int, model: str, text: str, tokens: int) -> tuple[float, float, int]:
    """A streamed response sent with a client's traceparent: (seconds to first text, tokens/s after it, tokens)."""
    body = json.dumps({"model": model, "input": user_input(text), "stream": True, "max_output_tokens": tokens,
                       "temperature": 0}).encode()
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    stream = SseStream(HOST, port, "POST", "/lmsp/v1/responses", body, {"traceparent": traceparent})
    start = time.perf_counter()
    first = 0.0
    made = 0
    async for arrived, events in stream.batches():
        for event in events:
            if event.name == wire.TEXT_DELTA and not first:
                first = arrived
            if event.name in wire.FINAL_EVENTS:
                made = json.loads(event.data).get("usage", {}).get("output_tokens", 0)
                first = first or arrived
    end = time.perf_counter()
    return first - start, (made - 1) / (end - first) if made > 1 and end > first else 0.0, made


@contextlib.contextmanager
def stack_for(spec: dict[str, Any], mode: str) -> Iterator[tuple[Stack, SpanSink | None]]:
    sink = SpanSink() if mode == "on" else None
    env = {} if sink is None else {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}"}
    stack = Stack([spec], [spec["id"]], torch_threads=1, extra_env=env)
    try:
        yield stack.__enter__(), sink
    finally:
        stack.__exit__(None, None, None)
        if sink is not None:
            sink.close()


async def measure(args: argparse.Namespace, spec: dict[str, Any], mode: str) -> Run:
    run = Run(mode)
    with stack_for(spec, mode) as (stack, sink):
        await one_stream(stack.api_port, spec["id"], prompt_text(0), args.tokens)  # warm-up
        api, worker = cpu_seconds(stack.api.pid), cpu_seconds(stack.worker.pid)
        for number in range(args.streams):
            ttft, rate, made = await one_stream(stack.api_port, spec["id"], prompt_text(number + 1), args.tokens)
            run.streams.append({"ttft_ms": ttft * 1000, "tokens_per_s": rate, "tokens": made})
            run.tokens += made
        api, worker = cpu_seconds(stack.api.pid) - api, cpu_seconds(stack.worker.pid) - worker
    run.spans = sink.spans if sink is not None else 0  # the processes sent the rest as they stopped
    run.ttft_ms = statistics.median(stream["ttft_ms"] for stream in run.streams)
    run.tokens_per_s = statistics.median(stream["tokens_per_s"] for stream in run.streams)
    run.cpu_us_per_token = {"api": api / run.tokens * 1e6, "worker": worker / run.tokens * 1e6}
    print(f"  tracing {mode}: {run.tokens_per_s:.1f} tokens/s, TTFT {run.ttft_ms:.0f} ms, CPU a token: API "
          f"{run.cpu_us_per_token['api']:.0f} us, worker {run.cpu_us_per_token['worker']:.0f} us"
          + (f"; {run.spans} spans received" if mode == "on" else ""), flush=True)
    return run


def span_cost(tasks: int) -> float:
    """CPU seconds a task's spans cost (this process: ``OTEL_EXPORTER_OTLP_ENDPOINT`` names a receiver
    elsewhere), their export included."""
    assert tracing.setup("lmsp-bench"), "no OTEL_EXPORTER_OTLP_ENDPOINT"
    started = time.process_time()
    for number in range(tasks):
        client = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        request = tracing.start("POST /lmsp/v1/responses", client, kind="server", attributes={
            "http.request.method": "POST", "http.route": "/lmsp/v1/responses", "url.path": "/lmsp/v1/responses"})
        request.set({"gen_ai.request.model": "m", "gen_ai.response.id": f"resp_{number}", "lmsp.task.id": "t"})
        now = time.time()
        run = tracing.RunTrace(request.traceparent, model="m", task_id=f"task_{number}", response_id=f"resp_{number}",
                               attempt=1, worker="w", created_at=now, claimed_at=now)
        run.prefill(40, 0)
        run.first_token()
        run.generation_ended("length")
        run.close("incomplete", 256)
        request.set({"http.response.status_code": 200})
        request.end()
    tracing.shutdown()  # every span exported
    return (time.process_time() - started) / tasks


def measure_span_cost(tasks: int) -> tuple[float, int]:
    """``span_cost`` in a process of its own: (CPU seconds a task, spans received)."""
    sink = SpanSink()
    try:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}"}
        result = subprocess.run([sys.executable, "-m", "bench.tracing", "--span-cost", str(tasks)], env=env,
                                capture_output=True, text=True, check=True)
    finally:
        sink.close()
    return float(result.stdout.strip()), sink.spans


def report(table: Table, runs: list[Run]) -> None:
    on = [run for run in runs if run.mode == "on"]
    off = [run for run in runs if run.mode == "off"]

    def median(of: list[Run], name: str, part: str | None = None) -> float:
        return float(statistics.median(getattr(run, name)[part] if part else getattr(run, name) for run in of))

    table.add("one stream: tokens/s, tracing on / off", f"{median(on, 'tokens_per_s'):.1f}",
              f"{median(off, 'tokens_per_s'):.1f} off", ratio(median(on, 'tokens_per_s'), median(off, 'tokens_per_s')),
              "~1.0")
    table.add("  time to first token, ms", f"{median(on, 'ttft_ms'):.0f}", f"{median(off, 'ttft_ms'):.0f} off",
              ratio(median(on, 'ttft_ms'), median(off, 'ttft_ms')), "~1.0")
    for part in ("api", "worker"):
        mine, theirs = median(on, "cpu_us_per_token", part), median(off, "cpu_us_per_token", part)
        table.add(f"  {part} CPU a token, us", f"{mine:.0f}", f"{theirs:.0f} off", ratio(mine, theirs), "<= 1.05")
    table.add("  spans received a stream (on)", f"{median(on, 'spans') / (len(on[0].streams) + 1):.1f}")


def report_span_cost(table: Table, runs: list[Run], seconds: float, tokens: int) -> None:
    """The spans' own CPU a task, spread over a stream's tokens, against a token's CPU with tracing off."""
    off = [run for run in runs if run.mode == "off"]
    token = statistics.median(run.cpu_us_per_token["api"] + run.cpu_us_per_token["worker"] for run in off)
    share = seconds * 1e6 / tokens
    table.add("spans' CPU a task (in process, exported)", f"{seconds * 1e6:.0f} us")
    table.add(f"  a token of a {tokens}-token stream, share of its CPU off", f"{share:.2f} us",
              f"{token:.0f} us off", f"{share / token:.4f}" if token else "-", "<= 0.05")


async def main(args: argparse.Namespace) -> None:
    spec = msgspec.to_builtins(Catalog.from_settings(load_settings()).get(args.model))
    table = Table()
    runs: list[Run] = []
    started = time.perf_counter()
    print(f"tracing on / off: model {spec['id']}, {args.streams} streams of {args.tokens} tokens one after the "
          f"other; fresh stacks, median of {args.rounds} rounds", flush=True)
    for number in range(args.rounds):
        for mode in MODES if number % 2 == 0 else MODES[::-1]:
            runs.append(await measure(args, spec, mode))
    cost, spans = measure_span_cost(args.span_tasks)
    print(f"  spans alone: {cost * 1e6:.0f} us of CPU a task ({spans} spans received)", flush=True)
    report(table, runs)
    report_span_cost(table, runs, cost, args.tokens)
    seconds = time.perf_counter() - started
    print(f"{seconds:.0f} s in all")
    print()
    print(table.render())
    if args.json:
        figures = {**host(), "command": " ".join(["python -m bench.tracing", *sys.argv[1:]]), "model": spec["id"],
                   **{name: getattr(args, name) for name in ("streams", "tokens", "rounds", "span_tasks")},
                   "span_cpu_us_a_task": cost * 1e6, "spans_received_in_span_cost": spans,
                   "run_seconds": round(seconds),
                   "table": [dict(zip(("measure", "on", "off", "ratio", "target"), row, strict=True))
                             for row in table.rows],
                   "runs": [asdict(run) for run in runs]}
        args.json.write_text(json.dumps(rounded(figures), indent=1) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m-instruct")
    parser.add_argument("--streams", type=int, default=8, help="streams measured a stack, one after the other")
    parser.add_argument("--tokens", type=int, default=128, help="max_output_tokens of every stream")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of fresh stacks, tracing off and on")
    parser.add_argument("--span-tasks", type=int, default=2000, help="tasks whose spans --span-cost makes")
    # the child process of measure_span_cost
    parser.add_argument("--span-cost", type=int, metavar="TASKS", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.streams, args.tokens, args.rounds, args.span_tasks = "tiny-random", 2, 16, 1, 50
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.span_cost:
        print(span_cost(arguments.span_cost))
    else:
        asyncio.run(main(arguments))
