"""What a token costs on its way from the model to the client, at GPU rates, on a CPU.

Starts Redis, one API process and a worker whose model computes nothing (``bench.simulated``: every
stream gets a token every ``1 / rate`` seconds), so that all the work measured is the event plane's:
the engine's hand-off to the event loop, ``TaskRun``, the output path, the writer, the append script,
the API's hub and its SSE. For each count of streams and of followers per stream it queues the
tasks, follows each with that many SSE clients (as cheap as a client can be: bytes are kept with
their arrival time and read afterwards), and over a window in which every stream runs it measures,
per generated token: the worker's CPU, Redis's CPU, calls and bytes, the API's CPU per follower; and
the delivery lag from the model's step to a client's receipt, p50 and p99. Then, with the model
unpaced, the most tokens a second one worker process carries.

    python -m bench.eventplane [--streams 64 256] [--followers 1 4] [--rate 150] [--seconds 3]
                               [--rounds 3] [--capacity 64 256] [--json FILE]

Every figure is CPU time or a count, except the lag and the capacity: those share this machine's
cores with the client and every other process.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import redis.asyncio as aioredis

from bench.report import Table, percentile
from bench.simulated import CLOCK, SYMBOLS, StepLog
from bench.sse import HOST
from bench.stack import Stack, cpu_seconds
from bench.tasks import create_task
from lmsp_core import wire

MODEL = "bench-simulated"
SPEC: dict[str, Any] = {"id": MODEL, "source": "tiny-random", "context_window": 8192, "max_output_tokens": 8192,
                        "capabilities": ["streaming"], "device": "cpu", "reuse_prefixes": False}
RAMP_SECONDS = 4.0  # a stream's tokens beyond the window: for queueing, following and the ramp
SAMPLE_EVERY = 0.25  # seconds between the counters' samples
MIN_WINDOW = 0.5  # seconds measured at least
WARM_UP_SECONDS = 1.0
WAIT_SECONDS = 900.0  # for the followers to receive every event once the window is over


# --- following ---------------------------------------------------------------------------------


class Follower(asyncio.Protocol):
    """An SSE client that only keeps what arrives, with the time it arrived; ``events`` reads it."""

    def __init__(self, task_id: str) -> None:
        self.request = (f"GET /lmsp/v1/tasks/{task_id}/events HTTP/1.1\r\nHost: {HOST}\r\n"
                        "Accept: text/event-stream\r\nConnection: close\r\n\r\n").encode()
        self.arrived: list[tuple[float, bytes]] = []
        self.closed = asyncio.get_running_loop().create_future()
        self.opened = CLOCK()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.opened = CLOCK()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.arrived.append((CLOCK(), data))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def events(self) -> list[tuple[float, int, str, bytes]]:
        """(arrival time, id, name, data) of every event, read from the chunked body."""
        raw = b"".join(data for _, data in self.arrived)
        ends = np.cumsum([len(data) for _, data in self.arrived])
        times = [arrived for arrived, _ in self.arrived]
        body, offsets = _dechunk(raw, raw.index(b"\r\n\r\n") + 4)
        events = []
        start = 0
        while (end := body.find(b"\n\n", start)) >= 0:
            block, start = body[start:end], end + 2
            fields = dict(line.split(b": ", 1) for line in block.split(b"\n") if not line.startswith(b":"))
            if b"id" in fields:
                at = times[int(np.searchsorted(ends, offsets[int(np.searchsorted(offsets[:, 0], end))][1], "right"))]
                events.append((at, int(fields[b"id"]), fields[b"event"].decode(), fields[b"data"]))
        return events


def _dechunk(raw: bytes, position: int) -> tuple[bytes, np.ndarray]:
    """The body of a chunked response, and for each chunk (its end in the body, its end in ``raw``)."""
    parts: list[bytes] = []
    offsets: list[tuple[int, int]] = []
    length = 0
    while True:
        line_end = raw.index(b"\r\n", position)
        size = int(raw[position:line_end], 16)
        if size == 0:
            return b"".join(parts), np.asarray(offsets or [(0, 0)], dtype=np.int64)
        start = line_end + 2
        parts.append(raw[start:start + size])
        length += size
        offsets.append((length, start + size - 1))
        position = start + size + 2


# --- counters ----------------------------------------------------------------------------------


@dataclass
class Sample:
    at: float
    worker_cpu: float
    api_cpu: float
    redis_cpu: float
    redis_calls: int
    redis_scripts: int
    redis_bytes: int


async def sample(stack: Stack, redis: aioredis.Redis) -> Sample:
    info = await redis.info("all")
    calls = {name: value["calls"] for name, value in info.items() if name.startswith("cmdstat_")}
    return Sample(at=CLOCK(), worker_cpu=cpu_seconds(stack.worker.pid), api_cpu=cpu_seconds(stack.api.pid),
                  redis_cpu=info["used_cpu_sys"] + info["used_cpu_user"], redis_calls=sum(calls.values()),
                  redis_scripts=calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0),
                  redis_bytes=info["total_net_input_bytes"] + info["total_net_output_bytes"])


# --- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    streams: int
    followers: int
    rate: float
    tokens: int = 0  # produced in the window
    seconds: float = 0.0
    per_token: dict[str, float] = field(default_factory=dict)
    lag_ms: dict[str, float] = field(default_factory=dict)
    complete: bool = True
    rounds: list[dict[str, dict[str, float]]] = field(default_factory=list)


async def run_once(stack: Stack, log: StepLog, streams: int, followers: int, rate: float, seconds: float) -> Run:
    redis = aioredis.Redis.from_url(stack.redis_url)
    loop = asyncio.get_running_loop()
    # paced: long enough for the window; unpaced: as long as the context window allows
    length = int(rate * (seconds + RAMP_SECONDS)) if rate else SPEC["context_window"] - 64
    try:
        tasks = await asyncio.gather(*(create_task(stack.api_port, model=MODEL, text=f"stream {i}",
                                                   max_output_tokens=length) for i in range(streams)))
        clients = [Follower(task["id"]) for task in tasks for _ in range(followers)]
        for client in clients:
            await loop.create_connection(lambda client=client: client, HOST, stack.api_port)  # type: ignore[misc]
        while not all(client.arrived for client in clients):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        samples = [await sample(stack, redis)]
        while samples[-1].at - samples[0].at < seconds and not any(client.closed.done() for client in clients):
            await asyncio.sleep(SAMPLE_EVERY)
            samples.append(await sample(stack, redis))
        await asyncio.wait_for(asyncio.gather(*(client.closed for client in clients)), WAIT_SECONDS)
    finally:
        await redis.aclose()
    return measure(log, clients, samples, Run(streams, followers, rate), length)


def measure(log: StepLog, clients: list[Follower], samples: list[Sample], run: Run, length: int) -> Run:
    """The run's figures between the first sample and the last one before any stream ended."""
    received = [client.events() for client in clients]
    ended = min((events[-1][0] for events in received if events and events[-1][2] in wire.FINAL_EVENTS),
                default=samples[-1].at)
    first = samples[0]
    last = max((s for s in samples if s.at <= ended), key=lambda s: s.at)
    run.tokens = log.tokens_between(first.at, last.at)
    run.seconds = last.at - first.at
    if run.seconds < MIN_WINDOW:
        raise RuntimeError(f"the streams ended {run.seconds:.2f} s into the window: too short to measure")
    tokens = max(run.tokens, 1)
    run.per_token = {
        "worker_cpu_us": 1e6 * (last.worker_cpu - first.worker_cpu) / tokens,
        "redis_cpu_us": 1e6 * (last.redis_cpu - first.redis_cpu) / tokens,
        "redis_calls": (last.redis_calls - first.redis_calls) / tokens,
        "redis_scripts": (last.redis_scripts - first.redis_scripts) / tokens,
        "redis_bytes": (last.redis_bytes - first.redis_bytes) / tokens,
        "api_cpu_us_per_follower": 1e6 * (last.api_cpu - first.api_cpu) / tokens / run.followers,
        "tokens_per_s": run.tokens / run.seconds,
    }
    lags = delivery_lags(log, received, first.at, last.at)
    run.lag_ms = {"p50": 1e3 * percentile(lags, 50), "p99": 1e3 * percentile(lags, 99),
                  "max": 1e3 * max(lags)} if lags else {}
    run.complete = all(_complete(events, length) for events in received)
    return run


def delivery_lags(log: StepLog, received: list[list[tuple[float, int, str, bytes]]], start: float,
                  end: float) -> list[float]:
    """Seconds from the step that produced each character of the text deltas to its arrival, for the
    characters produced between ``start`` and ``end``."""
    times = np.asarray(log.rows[:log.steps(), 0])
    arrivals: list[list[float]] = [[] for _ in SYMBOLS]
    index = {ord(symbol): i for i, symbol in enumerate(SYMBOLS)}
    for events in received:
        for at, _, name, data in events:
            if name == wire.TEXT_DELTA:
                for char in msgspec.json.decode(data, type=wire.OutputTextDelta).delta.encode():
                    arrivals[index[char]].append(at)
    lags: list[float] = []
    for symbol, when in enumerate(arrivals):
        steps = times[symbol::len(SYMBOLS)]  # in step order, so in time order
        arrived = np.asarray(when)
        made = steps[np.searchsorted(steps, arrived, "right") - 1]
        kept = (made > start) & (made <= end)
        lags += (arrived[kept] - made[kept]).tolist()
    return lags


def _complete(events: list[tuple[float, int, str, bytes]], length: int) -> bool:
    ids = [event_id for _, event_id, _, _ in events]
    text: int = sum(len(msgspec.json.decode(data, type=wire.OutputTextDelta).delta)
                    for _, _, name, data in events if name == wire.TEXT_DELTA)
    return ids == list(range(1, len(ids) + 1)) and text == length and events[-1][2] in wire.FINAL_EVENTS


# --- the benchmark ---------------------------------------------------------------------------------


def stack_for(rate: float, slots: int, log: Path) -> Stack:
    spec = SPEC | {"max_batch_size": slots}
    worker = [sys.executable, "-m", "bench.simulated", "--model", MODEL, "--rate", str(rate), "--log", str(log)]
    return Stack([spec], [MODEL], torch_threads=1, worker=worker)


async def paced(args: argparse.Namespace, table: Table, runs: list[Run]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        log_path = Path(directory) / "steps"
        with stack_for(args.rate, max(args.streams), log_path) as stack:
            log = StepLog(log_path)
            # a first run costs more than the next ones (code paths run for the first time, buffers
            # growing): a short one, not counted
            await run_once(stack, log, min(args.streams), 1, args.rate, WARM_UP_SECONDS)
            for streams in args.streams:
                for followers in args.followers:
                    rounds = [await run_once(stack, log, streams, followers, args.rate, args.seconds)
                              for _ in range(args.rounds)]
                    runs.append(median_run(rounds))
                    report(table, runs[-1])


async def capacity(args: argparse.Namespace, table: Table, runs: list[Run]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        log_path = Path(directory) / "steps"
        with stack_for(0.0, max(args.capacity), log_path) as stack:
            log = StepLog(log_path)
            await run_once(stack, log, min(args.capacity), 1, 0.0, WARM_UP_SECONDS)
            for streams in args.capacity:
                run = median_run([await run_once(stack, log, streams, 1, 0.0, args.seconds)
                                  for _ in range(args.rounds)])
                runs.append(run)
                table.add(f"{streams} streams, the model unpaced: tokens/s one worker carries",
                          f"{run.per_token['tokens_per_s']:,.0f}", "", "", ">= 20,000")
                table.add("  worker CPU a token; lag p50 / p99", f"{run.per_token['worker_cpu_us']:.1f} us",
                          _lag(run), "", "")


def median_run(rounds: list[Run]) -> Run:
    """Each figure's median over the rounds (this machine's speed drifts from one to the next); the
    rounds' own figures are kept in ``rounds``."""
    run = Run(rounds[0].streams, rounds[0].followers, rounds[0].rate, complete=all(r.complete for r in rounds))
    run.tokens = sum(r.tokens for r in rounds)
    run.seconds = sum(r.seconds for r in rounds)
    run.per_token = {key: statistics.median(r.per_token[key] for r in rounds) for key in rounds[0].per_token}
    run.lag_ms = {key: statistics.median(r.lag_ms[key] for r in rounds) for key in rounds[0].lag_ms}
    run.rounds = [{"per_token": r.per_token, "lag_ms": r.lag_ms} for r in rounds]
    return run


def report(table: Table, run: Run) -> None:
    name = f"{run.streams} streams x {run.followers} follower{'s' if run.followers > 1 else ''}"
    per = run.per_token
    complete = "" if run.complete else " (INCOMPLETE!)"
    table.add(f"{name} at {run.rate:g} tokens/s each: tokens/s{complete}", f"{per['tokens_per_s']:,.0f}")
    table.add("  worker CPU a token (host path)", f"{per['worker_cpu_us']:.1f} us", "", "", "<= 25 us")
    table.add("  Redis CPU a token", f"{per['redis_cpu_us']:.1f} us", "", "", "<= 10 us")
    table.add("  Redis calls (scripts) and bytes a token",
              f"{per['redis_calls']:.2f} ({per['redis_scripts']:.2f}), {per['redis_bytes']:.0f} B")
    table.add("  API CPU a token, per follower", f"{per['api_cpu_us_per_follower']:.1f} us", "", "", "<= 25 us")
    table.add("  delivery lag, model to client: p50 / p99 (max)", _lag(run), "", "",
              "p99 <= 50 ms" if run.streams >= 256 else "")


def _lag(run: Run) -> str:
    lag = run.lag_ms
    return f"{lag['p50']:.1f} / {lag['p99']:.1f} ms ({lag['max']:.0f})" if lag else "-"


async def main(args: argparse.Namespace) -> None:
    table = Table()
    runs: list[Run] = []
    print(f"event plane: {os.cpu_count()} CPUs; a simulated model; {args.seconds:g} s windows, median of "
          f"{args.rounds}", flush=True)
    if args.streams and args.followers:
        await paced(args, table, runs)
    if args.capacity:
        await capacity(args, table, runs)
    print()
    print(table.render())
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "runs": [asdict(run) for run in runs]},
                                        indent=1) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--followers", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--rate", type=float, default=150.0, help="tokens a second of each stream")
    parser.add_argument("--seconds", type=float, default=3.0, help="the window measured")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each configuration (median)")
    parser.add_argument("--capacity", type=int, nargs="*", default=[64, 256],
                        help="streams with the model unpaced (none: skip)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
