"""``python -m bench.throughput --replication``: what acknowledging events on a replica costs.

A primary with one replica serves the same model under two ids: one variant acknowledges events
(and task creations) on the primary alone, the other on the replica too (``WAIT 1`` after each flush
of the writer: docs/reliability.md, "Replication and failover"). Concurrent streams and time to first
token in interleaved rounds, and the writer's flush round trip itself (this process appends one
event per flush to a task of its own, alternating between the two settings); then the replica is
killed, and every flush of the waiting variant waits out ``LMSP_REDIS_WAIT_TIMEOUT``.
"""

import argparse
import os
import statistics
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from bench.report import Table, percentile, prompt_text, ratio
from bench.sse import concurrent_streams, stream_response
from bench.stack import ReplicatedStack
from bench.tasks import UNSERVED, claim_task, create_task
from lmsp_core import wire
from lmsp_core.settings import Settings

FLUSHES = 200  # per setting and phase


async def replication(args: argparse.Namespace, spec: Any, threads: int, table: Table) -> None:
    """Rows of ``table``: each concurrency of ``args.streams`` and TTFT, replica up, then away."""
    alone, waiting = spec.id, f"{spec.id}@replica"
    served = msgspec.structs.replace(spec, max_batch_size=max(spec.max_batch_size, *args.streams))
    models = [msgspec.to_builtins(msgspec.structs.replace(served, id=name)) for name in (alone, waiting, UNSERVED)]
    variants = {alone: {"LMSP_REDIS_WAIT_REPLICAS": "0"}, waiting: {"LMSP_REDIS_WAIT_REPLICAS": "1"}}
    with ReplicatedStack(models, variants, threads) as stack:
        print(f"model {spec.id}, {threads} torch threads, {os.cpu_count()} CPUs; {args.tokens} tokens per stream, "
              f"median of {args.rounds} interleaved rounds", flush=True)
        for name in variants:
            await stream_response(stack.api_ports[name], name, prompt_text(0), 8)  # warm-up
        for label in ("replica up", "replica away"):
            if label == "replica away":
                stack.kill_replica()
            await compare_acknowledgements(args, stack, (alone, waiting), table, label)
            await flush_round_trip(stack, stack.api_ports[alone], table, label)


async def compare_acknowledgements(args: argparse.Namespace, stack: ReplicatedStack, names: tuple[str, str],
                                   table: Table, label: str) -> None:
    alone, waiting = names
    for count in args.streams:
        rates: dict[str, list[float]] = {name: [] for name in names}
        gapless = True
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:  # neither always goes first
                tokens, seconds, round_gapless = await concurrent_streams(stack.api_ports[name], name, count,
                                                                          args.tokens)
                rates[name].append(tokens / seconds)
                gapless = gapless and round_gapless
        rate, base = statistics.median(rates[waiting]), statistics.median(rates[alone])
        table.add(f"{label}: {count} streams tokens/s, events on a replica (WAIT 1)" + ("" if gapless else " (GAPS!)"),
                  f"{rate:.1f}", f"{base:.1f} primary alone", ratio(rate, base))
    ttft: dict[str, list[float]] = {name: [] for name in names}
    for sample in range(args.ttft_samples):
        for name in names if sample % 2 == 0 else names[::-1]:
            result = await stream_response(stack.api_ports[name], name, prompt_text(0), 1)
            ttft[name].append(result.ttft * 1000)
    added = statistics.median(w - a for w, a in zip(ttft[waiting], ttft[alone], strict=True))
    table.add(f"{label}: TTFT p50, events on a replica (WAIT 1)", f"{statistics.median(ttft[waiting]):.1f} ms",
              f"{statistics.median(ttft[alone]):.1f} ms primary alone", f"{added:+.1f} ms")


async def flush_round_trip(stack: ReplicatedStack, api_port: int, table: Table, label: str) -> None:
    """The writer's flush of one event, with and without WAIT 1, alternating, on tasks of our own
    (queued on a model no worker serves, claimed here as a worker would)."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    times: dict[int, list[float]] = {0: [], 1: []}
    try:
        writers = {}
        for replicas in times:
            settings = Settings(redis_url=stack.redis_url, redis_wait_replicas=replicas)
            task = await create_task(api_port)
            _, writer, run = await claim_task(redis, settings, task["id"], "bench/flush")
            writers[replicas] = (writer, run)
        for i in range(FLUSHES):
            for replicas in (0, 1) if i % 2 == 0 else (1, 0):
                writer, run = writers[replicas]
                writer.event(run, wire.TEXT_DELTA,
                             wire.OutputTextDelta(response_id=run.response_id, item_id="msg_bench", delta=f" word{i}"))
                writer.tokens(run, [i])
                start = time.perf_counter()
                await writer.flush()
                times[replicas].append((time.perf_counter() - start) * 1000)
    finally:
        await redis.aclose()
    added = statistics.median(times[1]) - statistics.median(times[0])
    table.add(f"{label}: writer flush round trip p50 / p99, events on a replica (WAIT 1)",
              f"{percentile(times[1], 50):.2f} / {percentile(times[1], 99):.2f} ms",
              f"{percentile(times[0], 50):.2f} / {percentile(times[0], 99):.2f} ms primary alone", f"{added:+.2f} ms")
