"""``python -m bench.throughput --replication``: what acknowledging events on a replica costs.

A primary with one replica serves the same model under two ids: one variant acknowledges events
(and task creations) on the primary alone, the other on the replica too (``WAIT 1`` after each flush
of the writer: docs/reliability.md, "Replication and failover"). Concurrent streams and time to first
token in interleaved rounds; then the replica is killed, and every flush of the waiting variant
waits out ``LMSP_REDIS_WAIT_TIMEOUT``.
"""

import argparse
import os
import statistics
from typing import Any

import msgspec

from bench.stack import ReplicatedStack
from bench.throughput import Table, concurrent_streams, prompt_text, ratio, stream_response


async def replication(args: argparse.Namespace, spec: Any, threads: int, table: Table) -> None:
    """Rows of ``table``: each concurrency of ``args.streams`` and TTFT, replica up, then away."""
    alone, waiting = spec.id, f"{spec.id}@replica"
    served = msgspec.structs.replace(spec, max_batch_size=max(spec.max_batch_size, *args.streams))
    models = [msgspec.to_builtins(msgspec.structs.replace(served, id=name)) for name in (alone, waiting)]
    variants = {alone: {"LMSP_REDIS_WAIT_REPLICAS": "0"}, waiting: {"LMSP_REDIS_WAIT_REPLICAS": "1"}}
    with ReplicatedStack(models, variants, threads) as stack:
        print(f"model {spec.id}, {threads} torch threads, {os.cpu_count()} CPUs; {args.tokens} tokens per stream, "
              f"median of {args.rounds} interleaved rounds", flush=True)
        for name in variants:
            await stream_response(stack.api_ports[name], name, prompt_text(0), 8)  # warm-up
        await compare_acknowledgements(args, stack, (alone, waiting), table, "replica up")
        stack.kill_replica()
        await compare_acknowledgements(args, stack, (alone, waiting), table, "replica away")


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
            ttft[name].append((await stream_response(stack.api_ports[name], name, prompt_text(0), 1)).ttft * 1000)
    added = statistics.median(w - a for w, a in zip(ttft[waiting], ttft[alone], strict=True))
    table.add(f"{label}: TTFT p50, events on a replica (WAIT 1)", f"{statistics.median(ttft[waiting]):.1f} ms",
              f"{statistics.median(ttft[alone]):.1f} ms primary alone", f"{added:+.1f} ms")
