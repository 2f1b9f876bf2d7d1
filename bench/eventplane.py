"""What a token costs on its way from the model to the client, at GPU rates, on a CPU, on one Redis
and on a Redis Cluster of three shards.

Starts Redis, one API process and a worker whose model computes nothing (``bench.simulated``: every
stream gets a token every ``1 / rate`` seconds), so that all the work measured is the event plane's:
the engine's hand-off to the event loop, ``TaskRun``, the output path, the writer, the append script,
the API's hub and its SSE. For each count of streams and of followers per stream it queues the
tasks, follows each with that many SSE clients (as cheap as a client can be: bytes are kept with
their arrival time and read afterwards), and over a window in which every stream runs it measures,
per generated token: the worker's CPU, Redis's CPU, calls and bytes, the API's CPU per follower; the
tokens a Redis CPU-second carries (all of Redis, and its busiest shard); and the delivery lag from
the model's step to a client's receipt, p50 and p99. Then, with the model unpaced, the most tokens a
second one worker process carries.

It does so for each backend of ``--redis``, a stack of its own each: ``single``, one redis-server;
``cluster``, a Redis Cluster of three primaries (``bench.stack.ClusterStack``), whose Redis figures
are the sums over the shards. Neither has a replica, and neither waits for one
(``LMSP_REDIS_WAIT_REPLICAS=0``): the comparison is of the sharding and the cluster client alone.
With both, the table has a column each and the ratio cluster / single; for the cluster, how evenly
the runs' events spread over the shards (each shard's share of the mean, from the streams' XLEN).

    python -m bench.eventplane [--redis single cluster] [--streams 64 256] [--followers 1 4]
                               [--rate 150] [--seconds 3] [--rounds 3] [--capacity 64 256] [--json FILE]

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
from redis.asyncio.cluster import RedisCluster

from bench.follower import Follower
from bench.report import Table, percentile, ratio
from bench.simulated import CLOCK, SYMBOLS, StepLog
from bench.sse import HOST
from bench.stack import ClusterStack, Stack, cpu_seconds
from bench.tasks import create_task
from lmsp_core import wire
from lmsp_core.store import keys

MODEL = "bench-simulated"
SPEC: dict[str, Any] = {"id": MODEL, "source": "tiny-random", "context_window": 8192, "max_output_tokens": 8192,
                        "capabilities": ["streaming"], "device": "cpu", "reuse_prefixes": False}
RAMP_SECONDS = 4.0  # a stream's tokens beyond the window: for queueing, following and the ramp
SAMPLE_EVERY = 0.25  # seconds between the counters' samples
MIN_WINDOW = 0.5  # seconds measured at least
WARM_UP_TOKENS = 256  # of each stream of the run that is not measured
BACKENDS: dict[str, type[Stack]] = {"single": Stack, "cluster": ClusterStack}
WAIT_SECONDS = 900.0  # for the followers to receive every event once the window is over


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
    shard_cpu: list[float]  # each primary's, in the stack's order (``redis_cpu`` is their sum)


async def sample(stack: Stack, redises: list[aioredis.Redis]) -> Sample:
    """The counters now; Redis's summed over ``redises``, a client of each primary."""
    infos = await asyncio.gather(*(redis.info("all") for redis in redises))
    calls = [{name: value["calls"] for name, value in info.items() if name.startswith("cmdstat_")} for info in infos]
    shard_cpu = [info["used_cpu_sys"] + info["used_cpu_user"] for info in infos]
    return Sample(at=CLOCK(), worker_cpu=cpu_seconds(stack.worker.pid), api_cpu=cpu_seconds(stack.api.pid),
                  redis_cpu=sum(shard_cpu), redis_calls=sum(sum(one.values()) for one in calls),
                  redis_scripts=sum(one.get("cmdstat_evalsha", 0) + one.get("cmdstat_eval", 0) for one in calls),
                  redis_bytes=sum(info["total_net_input_bytes"] + info["total_net_output_bytes"] for info in infos),
                  shard_cpu=shard_cpu)


# --- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    backend: str  # a key of BACKENDS
    streams: int
    followers: int
    rate: float
    tokens: int = 0  # produced in the window
    seconds: float = 0.0
    per_token: dict[str, float] = field(default_factory=dict)
    lag_ms: dict[str, float] = field(default_factory=dict)
    complete: bool = True
    shard_cpu_s: list[float] = field(default_factory=list)  # each primary's Redis CPU in the window
    shard_events: list[int] = field(default_factory=list)  # the run's events on each shard (a cluster's)
    rounds: list[dict[str, Any]] = field(default_factory=list)


async def follow(stack: Stack, streams: int, followers: int, length: int) -> tuple[list[str], list[Follower]]:
    """Queue ``streams`` tasks of ``length`` tokens and follow each with ``followers`` clients, once
    every client has received something: the tasks' ids and the clients."""
    loop = asyncio.get_running_loop()
    tasks = await asyncio.gather(*(create_task(stack.api_port, model=MODEL, text=f"stream {i}",
                                               max_output_tokens=length) for i in range(streams)))
    if refused := [task for task in tasks if "id" not in task]:
        raise RuntimeError(f"the API refused {len(refused)} of {streams} tasks, the first with {refused[0]}")
    clients = [Follower(task["id"]) for task in tasks for _ in range(followers)]
    for client in clients:
        await loop.create_connection(lambda client=client: client, HOST, stack.api_port)  # type: ignore[misc]
    while not all(client.arrived for client in clients):
        await asyncio.sleep(0.05)
    return [task["id"] for task in tasks], clients


async def warm_up(stack: Stack, streams: int) -> None:
    """A first run costs more than the next ones (code paths run for the first time, buffers
    growing): a short one, not measured, so it can neither be too short to measure nor, unpaced,
    take as long as a measured one."""
    # a fresh API's first request does one-time work that stalls its event loop; met by a burst,
    # a connection of the cluster client timed out, and redis-py's cluster pipeline then closed the
    # client under every request in flight (500s): the first request goes alone
    _, first = await follow(stack, 1, 1, WARM_UP_TOKENS)
    _, clients = await follow(stack, streams, 1, WARM_UP_TOKENS)
    await asyncio.wait_for(asyncio.gather(*(client.closed for client in first + clients)), WAIT_SECONDS)


async def run_once(stack: Stack, log: StepLog, streams: int, followers: int, rate: float, seconds: float) -> Run:
    redises = [aioredis.Redis.from_url(url) for url in stack.primaries]
    # paced: long enough for the window; unpaced: as long as the context window allows
    length = int(rate * (seconds + RAMP_SECONDS)) if rate else SPEC["context_window"] - 64
    try:
        task_ids, clients = await follow(stack, streams, followers, length)
        await asyncio.sleep(0.3)
        samples = [await sample(stack, redises)]
        while samples[-1].at - samples[0].at < seconds and not any(client.closed.done() for client in clients):
            await asyncio.sleep(SAMPLE_EVERY)
            samples.append(await sample(stack, redises))
        await asyncio.wait_for(asyncio.gather(*(client.closed for client in clients)), WAIT_SECONDS)
    finally:
        for redis in redises:
            await redis.aclose()
    run = measure(log, clients, samples, Run(stack.backend, streams, followers, rate), length)
    run.shard_events = await shard_events(stack, task_ids)
    return run


async def shard_events(stack: Stack, task_ids: list[str]) -> list[int]:
    """How many of these tasks' events each primary of a cluster holds (the XLEN of each task's
    stream, routed as the service routes it); nothing for one Redis."""
    if not isinstance(stack, ClusterStack):
        return []
    counts = dict.fromkeys(stack.nodes, 0)
    streams = [keys.events(task_id) for task_id in task_ids]
    async with RedisCluster.from_url(stack.primaries[0]) as cluster:
        lengths = await asyncio.gather(*(cluster.xlen(stream) for stream in streams))
        for stream, length in zip(streams, lengths, strict=True):
            counts[cluster.get_node_from_key(stream).name] += length
    return list(counts.values())


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
    run.shard_cpu_s = [end - start for start, end in zip(first.shard_cpu, last.shard_cpu, strict=True)]
    run.per_token = {
        "worker_cpu_us": 1e6 * (last.worker_cpu - first.worker_cpu) / tokens,
        "redis_cpu_us": 1e6 * (last.redis_cpu - first.redis_cpu) / tokens,
        "redis_calls": (last.redis_calls - first.redis_calls) / tokens,
        "redis_scripts": (last.redis_scripts - first.redis_scripts) / tokens,
        "redis_bytes": (last.redis_bytes - first.redis_bytes) / tokens,
        "api_cpu_us_per_follower": 1e6 * (last.api_cpu - first.api_cpu) / tokens / run.followers,
        "tokens_per_s": run.tokens / run.seconds,
        # tokens/s per Redis core: what Redis, and its busiest shard, would carry at full use
        "tokens_per_redis_cpu_s": _per(run.tokens, last.redis_cpu - first.redis_cpu),
        "tokens_per_busiest_shard_cpu_s": _per(run.tokens, max(run.shard_cpu_s)),
    }
    lags = delivery_lags(log, received, first.at, last.at)
    run.lag_ms = {"p50": 1e3 * percentile(lags, 50), "p99": 1e3 * percentile(lags, 99),
                  "max": 1e3 * max(lags)} if lags else {}
    run.complete = all(_complete(events, length) for events in received)
    return run


def _per(tokens: int, cpu_seconds: float) -> float:
    return tokens / cpu_seconds if cpu_seconds > 0 else 0.0


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


def stack_for(backend: str, rate: float, slots: int, log: Path) -> Stack:
    spec = SPEC | {"max_batch_size": slots}
    worker = [sys.executable, "-m", "bench.simulated", "--model", MODEL, "--rate", str(rate), "--log", str(log)]
    # neither backend has a replica, and a cluster's services would wait for one by default: the
    # backends are compared with no WAIT on either
    return BACKENDS[backend]([spec], [MODEL], torch_threads=1, worker=worker,
                             extra_env={"LMSP_REDIS_WAIT_REPLICAS": "0"})


async def measure_backend(args: argparse.Namespace, backend: str, rate: float, configurations: list[tuple[int, int]],
                          runs: list[Run]) -> None:
    """Each configuration (streams, followers) on a stack of ``backend`` whose model makes ``rate``
    tokens a second (0: unpaced), each the median of ``args.rounds`` runs."""
    with tempfile.TemporaryDirectory() as directory:
        log_path = Path(directory) / "steps"
        with stack_for(backend, rate, max(streams for streams, _ in configurations), log_path) as stack:
            log = StepLog(log_path)
            await warm_up(stack, min(streams for streams, _ in configurations))
            for streams, followers in configurations:
                runs.append(median_run([await run_once(stack, log, streams, followers, rate, args.seconds)
                                        for _ in range(args.rounds)]))
                progress(runs[-1])


def median_run(rounds: list[Run]) -> Run:
    """Each figure's median over the rounds (this machine's speed drifts from one to the next); the
    rounds' own figures are kept in ``rounds``; the shards' CPU and events are summed over them."""
    first = rounds[0]
    run = Run(first.backend, first.streams, first.followers, first.rate, complete=all(r.complete for r in rounds))
    run.tokens = sum(r.tokens for r in rounds)
    run.seconds = sum(r.seconds for r in rounds)
    run.per_token = {key: statistics.median(r.per_token[key] for r in rounds) for key in first.per_token}
    run.lag_ms = {key: statistics.median(r.lag_ms[key] for r in rounds) for key in first.lag_ms}
    run.shard_cpu_s = [sum(one) for one in zip(*(r.shard_cpu_s for r in rounds), strict=True)]
    run.shard_events = [sum(one) for one in zip(*(r.shard_events for r in rounds), strict=True)]
    run.rounds = [{"per_token": r.per_token, "lag_ms": r.lag_ms, "shard_cpu_s": r.shard_cpu_s,
                   "shard_events": r.shard_events} for r in rounds]
    return run


# --- the report ------------------------------------------------------------------------------------


def progress(run: Run) -> None:
    per = run.per_token
    print(f"  {run.backend}: {_name(run)}: {per['tokens_per_s']:,.0f} tokens/s; a token: worker "
          f"{per['worker_cpu_us']:.1f} us, Redis {per['redis_cpu_us']:.1f} us, API "
          f"{per['api_cpu_us_per_follower']:.1f} us a follower; lag {_lag(run)}{_spread(run, ', shards ')}"
          f"{'' if run.complete else ' (INCOMPLETE!)'}", flush=True)


def tabulate(runs: list[Run], backends: list[str]) -> Table:
    """The rows of each configuration: a column for each backend and, with two, the second's ratio
    to the first."""
    if len(backends) == 1:
        table = Table(echo=False)
    else:
        table = Table(head=("measure", backends[0], backends[1], f"{backends[1]}/{backends[0]}", "target"), echo=False)
    configurations: dict[tuple[float, int, int], dict[str, Run]] = {}
    for run in runs:
        configurations.setdefault((run.rate, run.streams, run.followers), {})[run.backend] = run
    for by_backend in configurations.values():
        report(table, [by_backend[backend] for backend in backends])
    return table


def report(table: Table, runs: list[Run]) -> None:
    """One configuration's rows, ``runs`` in the columns' order (its targets are the paced runs')."""
    run = runs[0]
    incomplete = [one.backend for one in runs if not one.complete]
    flag = f" (INCOMPLETE: {', '.join(incomplete)}!)" if incomplete else ""
    if run.rate:
        table.add(f"{_name(run)} at {run.rate:g} tokens/s each: tokens/s{flag}",
                  *_figure(runs, "tokens_per_s", "{:,.0f}"))
    else:
        table.add(f"{run.streams} streams, the model unpaced: tokens/s one worker carries{flag}",
                  *_figure(runs, "tokens_per_s", "{:,.0f}"), ">= 20,000")
    paced = bool(run.rate)
    table.add("  worker CPU a token (host path)", *_figure(runs, "worker_cpu_us", "{:.1f} us"),
              "<= 25 us" if paced else "")
    table.add("  Redis CPU a token (all shards)", *_figure(runs, "redis_cpu_us", "{:.1f} us"),
              "<= 10 us" if paced else "")
    table.add("  tokens/s per Redis core: tokens / Redis CPU-s, all shards",
              *_figure(runs, "tokens_per_redis_cpu_s", "{:,.0f}"))
    table.add("  tokens/s per Redis core: tokens / Redis CPU-s, the busiest shard",
              *_figure(runs, "tokens_per_busiest_shard_cpu_s", "{:,.0f}"))
    table.add("  Redis calls (scripts) and bytes a token",
              *_cells([f"{one.per_token['redis_calls']:.2f} ({one.per_token['redis_scripts']:.2f}), "
                       f"{one.per_token['redis_bytes']:.0f} B" for one in runs]))
    table.add("  API CPU a token, per follower", *_figure(runs, "api_cpu_us_per_follower", "{:.1f} us"),
              "<= 25 us" if paced else "")
    table.add("  delivery lag, model to client: p50 / p99 (max)", *_cells([_lag(one) for one in runs]),
              "p99 <= 50 ms" if paced and run.streams >= 256 else "")
    if any(one.shard_events for one in runs):
        table.add("  events a shard, most / fewest, of the mean", *_cells([_spread(one) or "-" for one in runs]))


def _figure(runs: list[Run], key: str, form: str) -> tuple[str, str, str]:
    values = [one.per_token[key] for one in runs]
    return _cells([form.format(value) for value in values], values)


def _cells(texts: list[str], values: list[float] | None = None) -> tuple[str, str, str]:
    """The backends' columns, and with two the second's ratio to the first (of ``values``)."""
    if len(texts) == 1:
        return texts[0], "", ""
    return texts[0], texts[1], ratio(values[1], values[0]) if values else ""


def _name(run: Run) -> str:
    return f"{run.streams} streams x {run.followers} follower{'s' if run.followers > 1 else ''}"


def _lag(run: Run) -> str:
    lag = run.lag_ms
    return f"{lag['p50']:.1f} / {lag['p99']:.1f} ms ({lag['max']:.0f})" if lag else "-"


def _spread(run: Run, prefix: str = "") -> str:
    """The most and the fewest events a shard holds, as shares of the mean; "" for one Redis."""
    total = sum(run.shard_events)
    if not total:
        return ""
    mean = total / len(run.shard_events)
    return f"{prefix}{max(run.shard_events) / mean:.2f} / {min(run.shard_events) / mean:.2f}"


async def main(args: argparse.Namespace) -> None:
    backends = list(dict.fromkeys(args.redis))
    runs: list[Run] = []
    print(f"event plane: {os.cpu_count()} CPUs; a simulated model; Redis: {' then '.join(backends)}; "
          f"{args.seconds:g} s windows, median of {args.rounds}", flush=True)
    # each part on every backend before the next part: the runs compared are close in time
    if args.streams and args.followers:
        for backend in backends:
            await measure_backend(args, backend, args.rate,
                                  [(streams, followers) for streams in args.streams for followers in args.followers],
                                  runs)
    if args.capacity:
        for backend in backends:
            await measure_backend(args, backend, 0.0, [(streams, 1) for streams in args.capacity], runs)
    print()
    print(tabulate(runs, backends).render())
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "cpus": os.cpu_count(), "backends": backends,
                                         "runs": [asdict(run) for run in runs]}, indent=1) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", nargs="+", choices=list(BACKENDS), default=list(BACKENDS),
                        help="the backends measured, a stack each (with two: the second's ratio to the first)")
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
