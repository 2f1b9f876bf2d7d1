"""What the fair share between principals costs one principal alone, and what it buys a second one.

Starts a fresh stack (``bench.stack.Stack``: redis-server, API, one worker) for every measurement,
with ``LMSP_FAIR_SHARE=1`` and ``=0`` in turn (the order swapped every round), and prints the
median of ``--rounds`` of each:

1. one principal (``LMSP_AUTH=none``) keeping ``--streams`` streamed tasks of ``--tokens`` output
   tokens busy for ``--seconds`` (after ``--warm-up``) on a worker with as many slots: tokens/s and
   tasks/s, on over off; the worker's, API's and Redis's CPU a task; Redis's calls a task (scripts).
   On, the API admits each job to the fair queue and a worker starts what its pick script returns;
   off, a worker starts jobs in arq's score order. Many short tasks of the tiny random model, so
   that the queue's work is a large part of a task's;
2. two principals (``LMSP_AUTH=tokens``, bearer tokens written into the stack's Redis): A queues
   ``--backlog`` tasks, then B queues ``--late``; B's median and longest wait from creation to
   start (the task records' ``created_at`` and ``started_at``). Off, B waits behind A's whole
   backlog; on, about one task's turn of a slot. Also: how many of A's tasks still waited when B
   queued, and A's backlog from its first task queued to its last ended.

    python -m bench.fairshare [--model tiny-random] [--streams 16] [--tokens 16] [--seconds 10]
                              [--backlog 200] [--late 5] [--rounds 5] [--json FILE]
    python -m bench.fairshare --quick: a smoke test (one round, a second of load, a backlog of 16,
        both measurements of a setting on one stack with bearer tokens, ``--one-stack``)

Every figure shares this machine's cores with the client and the other processes, and these VMs
drift: compare on with off within a round (the JSON keeps every round), not rates across runs.
"""

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis

from bench.report import Table, prompt_text, ratio, user_input
from bench.sse import HOST, SseStream
from bench.stack import ROOT, Stack, cpu_seconds
from lmsp_core import wire
from lmsp_core.requests.catalog import Catalog
from lmsp_core.settings import load_settings
from lmsp_core.store import keys
from lmsp_core.store.tenants import credentials

POLL_SECONDS = 0.05
DRAIN_TIMEOUT = 600.0  # for the two principals' tasks to start and end
SETTINGS = {"on": "1", "off": "0"}


# --- one principal, saturating --------------------------------------------------------------------


@dataclass
class Saturated:
    fair: str
    tasks: int = 0  # ended in the window
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    tasks_per_s: float = 0.0
    cpu_ms_per_task: dict[str, float] = field(default_factory=dict)  # worker, api, redis
    redis_calls_per_task: dict[str, float] = field(default_factory=dict)  # each command's, and "all"


async def _counters(stack: Stack, redis: aioredis.Redis) -> tuple[dict[str, float], dict[str, int]]:
    """CPU seconds of the worker, API and Redis so far; Redis's calls of each command."""
    info = await redis.info("all")
    calls = {name.removeprefix("cmdstat_"): value["calls"] for name, value in info.items()
             if name.startswith("cmdstat_")}
    return ({"worker": cpu_seconds(stack.worker.pid), "api": cpu_seconds(stack.api.pid),
             "redis": info["used_cpu_sys"] + info["used_cpu_user"]}, calls)


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def stream_one(port: int, model: str, text: str, tokens: int, token: str | None) -> int:
    """One task streamed through ``POST /lmsp/v1/responses``, to its end: its output tokens."""
    body = json.dumps({"model": model, "input": user_input(text), "stream": True, "max_output_tokens": tokens,
                       "temperature": 0}).encode()
    output = -1
    async for _, events in SseStream(HOST, port, "POST", "/lmsp/v1/responses", body, _auth(token)).batches():
        for event in events:
            if event.name in wire.FINAL_EVENTS:
                output = int(json.loads(event.data).get("usage", {}).get("output_tokens", 0))
    if output < 0:
        raise RuntimeError("a stream ended without its final event")
    return output


async def saturate(stack: Stack, args: argparse.Namespace, model: str, fair: str,
                   token: str | None = None) -> Saturated:
    """``--streams`` clients, each streaming one task after another until the window ends."""
    await stream_one(stack.api_port, model, prompt_text(0), args.tokens, token)  # the worker's first steps
    redis = aioredis.Redis.from_url(stack.redis_url)
    ended: list[tuple[float, int]] = []  # (when, output tokens) of every task
    start = time.perf_counter()
    window = (start + args.warm_up, start + args.warm_up + args.seconds)

    async def client(i: int) -> None:
        n = i
        while time.perf_counter() < window[1]:
            tokens = await stream_one(stack.api_port, model, prompt_text(n), args.tokens, token)
            ended.append((time.perf_counter(), tokens))
            n += args.streams

    async def sample() -> tuple[tuple[dict[str, float], dict[str, int]], tuple[dict[str, float], dict[str, int]]]:
        await asyncio.sleep(window[0] - time.perf_counter())
        first = await _counters(stack, redis)
        await asyncio.sleep(window[1] - time.perf_counter())
        return first, await _counters(stack, redis)

    try:
        sampled = asyncio.ensure_future(sample())
        await asyncio.gather(sampled, *(client(i) for i in range(args.streams)))
        (first, first_calls), (last, last_calls) = sampled.result()
    finally:
        await redis.aclose()
    counted = [n for at, n in ended if window[0] < at <= window[1]]
    run = Saturated(fair, tasks=len(counted), tokens=sum(counted), seconds=args.seconds)
    run.tokens_per_s, run.tasks_per_s = run.tokens / args.seconds, run.tasks / args.seconds
    tasks = max(1, run.tasks)
    run.cpu_ms_per_task = {name: 1000 * (last[name] - first[name]) / tasks for name in first}
    calls = {name: (count - first_calls.get(name, 0)) / tasks for name, count in last_calls.items()}
    run.redis_calls_per_task = {"all": sum(calls.values())} | {name: round(n, 2) for name, n in calls.items() if n}
    return run


# --- two principals ---------------------------------------------------------------------------------


@dataclass
class LateComer:
    fair: str
    b_wait_ms: list[float] = field(default_factory=list)  # each of B's tasks, creation to start
    b_wait_ms_median: float = 0.0
    b_wait_ms_max: float = 0.0
    a_waiting_when_b_queued: int = 0
    a_backlog_seconds: float = 0.0  # A's first task created to its last ended


async def post_task(port: int, token: str, model: str, text: str, tokens: int) -> str:
    """``POST /lmsp/v1/tasks`` with a bearer token; the new task's id."""
    body = json.dumps({"model": model, "input": user_input(text), "max_output_tokens": tokens,
                       "temperature": 0}).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                 .encode() + body)
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 202"):
        raise RuntimeError(f"creating a task: {head[:200]!r} {payload[:500]!r}")
    return str(json.loads(payload)["id"])


Times = list[tuple[float, float | None, float | None]]  # created_at, started_at, finished_at of tasks


async def _times(redis: aioredis.Redis, task_ids: list[str]) -> Times:
    """(created_at, started_at, finished_at) of each task, from its record."""
    async with redis.pipeline(transaction=False) as pipe:
        for task_id in task_ids:
            pipe.hmget(keys.task(task_id), ["created_at", "started_at", "finished_at"])
        replies = await pipe.execute()
    return [(float(created), None if started is None else float(started), None if finished is None else float(finished))
            for created, started, finished in replies]


async def _until(redis: aioredis.Redis, task_ids: list[str], column: int) -> Times:
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while time.monotonic() < deadline:
        times = await _times(redis, task_ids)
        if all(row[column] is not None for row in times):
            return times
        await asyncio.sleep(POLL_SECONDS)
    raise TimeoutError(f"{len(task_ids)} tasks did not all {'start' if column == 1 else 'end'}")


async def principals(stack: Stack) -> tuple[str, str]:
    """Bearer tokens of principals A and B, written straight into the stack's Redis."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        scopes = [credentials.TASKS_WRITE, credentials.TASKS_READ, credentials.RESPONSES_WRITE]
        token_a, _ = await credentials.create(redis, "principal-a", scopes)
        token_b, _ = await credentials.create(redis, "principal-b", scopes)
    finally:
        await redis.aclose()
    return token_a, token_b


async def late_comer(stack: Stack, args: argparse.Namespace, model: str, fair: str, token_a: str,
                     token_b: str) -> LateComer:
    """A queues ``--backlog`` tasks, then B ``--late``: how long B waits for a start."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        for token in (token_a, token_b):  # the worker's first steps, and each principal known
            await _until(redis, [await post_task(stack.api_port, token, model, "warm-up", args.tokens)], 2)
        gate = asyncio.Semaphore(8)

        async def queue_a(i: int) -> str:
            async with gate:
                return await post_task(stack.api_port, token_a, model, prompt_text(i), args.tokens)

        a_ids = await asyncio.gather(*(queue_a(i) for i in range(args.backlog)))
        b_ids = [await post_task(stack.api_port, token_b, model, prompt_text(i), args.tokens)
                 for i in range(args.late)]
        b_times = await _until(redis, b_ids, 1)
        a_times = await _until(redis, a_ids, 2)
    finally:
        await redis.aclose()
    run = LateComer(fair, b_wait_ms=[1000 * (started - created) for created, started, _ in b_times if started])
    run.b_wait_ms_median, run.b_wait_ms_max = statistics.median(run.b_wait_ms), max(run.b_wait_ms)
    b_queued = min(created for created, _, _ in b_times)
    run.a_waiting_when_b_queued = sum(1 for _, started, _ in a_times if started is None or started > b_queued)
    run.a_backlog_seconds = max(f for _, _, f in a_times if f) - min(created for created, _, _ in a_times)
    return run


# --- the benchmark -----------------------------------------------------------------------------------


@contextlib.contextmanager
def stack_for(spec: dict[str, Any], fair: str, auth: str) -> Iterator[Stack]:
    """A fresh stack with fair share ``fair``; stopped on the way out, also when it fails to start
    (``Stack.__enter__`` leaves what it started running when it raises)."""
    stack = Stack([spec], [spec["id"]], torch_threads=1,
                  extra_env={"LMSP_FAIR_SHARE": SETTINGS[fair], "LMSP_AUTH": auth})
    try:
        yield stack.__enter__()
    finally:
        stack.__exit__(None, None, None)


def _median(runs: list[Any], name: str) -> float:
    return float(statistics.median(getattr(run, name) for run in runs))


def report(table: Table, args: argparse.Namespace, saturated: list[Saturated], late: list[LateComer]) -> None:
    on = [run for run in saturated if run.fair == "on"]
    off = [run for run in saturated if run.fair == "off"]
    head = f"1 principal, {args.streams} streams x {args.tokens} tokens"
    for name, label, unit in (("tokens_per_s", "tokens/s", ""), ("tasks_per_s", "tasks/s", "")):
        mine, theirs = _median(on, name), _median(off, name)
        table.add(f"{head}: {label}, fair share on / off" if name == "tokens_per_s" else f"  {label}, on / off",
                  f"{mine:,.1f}{unit}", f"{theirs:,.1f}{unit} off", ratio(mine, theirs), "~1.0")
    for part in ("worker", "api", "redis"):
        mine = statistics.median(run.cpu_ms_per_task[part] for run in on)
        theirs = statistics.median(run.cpu_ms_per_task[part] for run in off)
        label = {"worker": "worker", "api": "API", "redis": "Redis"}[part]
        table.add(f"  {label} CPU a task, on / off", f"{mine:.2f} ms", f"{theirs:.2f} ms off", ratio(mine, theirs))
    calls = [statistics.median(run.redis_calls_per_task.get(name, 0.0) for run in runs) for runs in (on, off)
             for name in ("all", "evalsha")]
    table.add("  Redis calls a task (scripts), on / off", f"{calls[0]:.1f} ({calls[1]:.1f})",
              f"{calls[2]:.1f} ({calls[3]:.1f}) off", ratio(calls[0], calls[2]))
    on_late = [run for run in late if run.fair == "on"]
    off_late = [run for run in late if run.fair == "off"]
    table.add(f"2 principals: B's {args.late} tasks after A's {args.backlog}, wait to start: median (max)",
              f"{_median(on_late, 'b_wait_ms_median'):,.0f} ({_median(on_late, 'b_wait_ms_max'):,.0f}) ms",
              f"{_median(off_late, 'b_wait_ms_median'):,.0f} ({_median(off_late, 'b_wait_ms_max'):,.0f}) ms off",
              ratio(_median(on_late, "b_wait_ms_median"), _median(off_late, "b_wait_ms_median")),
              "on: about one task's turn")
    table.add("  A's tasks still waiting when B queued, on / off", f"{_median(on_late, 'a_waiting_when_b_queued'):.0f}",
              f"{_median(off_late, 'a_waiting_when_b_queued'):.0f} off")
    mine, theirs = _median(on_late, "a_backlog_seconds"), _median(off_late, "a_backlog_seconds")
    table.add("  A's backlog, first queued to last ended, on / off", f"{mine:.2f} s", f"{theirs:.2f} s off",
              ratio(mine, theirs), "~1.0")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def host() -> dict[str, Any]:
    """When, at which commit (and whether the tree had changes beyond it), on what CPU."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = line.partition(":")
        info.setdefault(name.strip(), value.strip())
    cpu = f"{info.get('model name', 'unknown')}, family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    return {"date": datetime.date.today().isoformat(), "commit": _git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": _git("status", "--porcelain", "--untracked-files=no") != "", "cpu": cpu,
            "cpus": os.cpu_count()}


def rounded(value: Any) -> Any:
    """The figures to 2 decimals, for the JSON."""
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


async def measure(args: argparse.Namespace, served: dict[str, Any], fair: str, saturated: list[Saturated],
                  late: list[LateComer]) -> None:
    """Both measurements with fair share ``fair``, each on a fresh stack (``--one-stack``: one)."""
    model = served["id"]
    if args.one_stack:
        with stack_for(served, fair, "tokens") as stack:
            token_a, token_b = await principals(stack)
            saturated.append(await saturate(stack, args, model, fair, token_a))
            late.append(await late_comer(stack, args, model, fair, token_a, token_b))
    else:
        with stack_for(served, fair, "none") as stack:
            saturated.append(await saturate(stack, args, model, fair))
        with stack_for(served, fair, "tokens") as stack:
            late.append(await late_comer(stack, args, model, fair, *await principals(stack)))
    one, two = saturated[-1], late[-1]
    print(f"  fair share {fair}: {one.tokens_per_s:,.1f} tokens/s, {one.tasks_per_s:,.1f} tasks/s; B waited "
          f"{two.b_wait_ms_median:,.0f} ms (max {two.b_wait_ms_max:,.0f}), {two.a_waiting_when_b_queued} of A's "
          "tasks waiting", flush=True)


async def main(args: argparse.Namespace) -> None:
    spec = Catalog.from_settings(load_settings()).get(args.model)
    served = msgspec.to_builtins(msgspec.structs.replace(spec, max_batch_size=args.streams))
    table = Table()
    saturated: list[Saturated] = []
    late: list[LateComer] = []
    started = time.perf_counter()
    print(f"fair share on / off: model {spec.id}, {args.streams} slots, {os.cpu_count()} CPUs; fresh stacks, "
          f"median of {args.rounds} rounds", flush=True)
    for number in range(args.rounds):  # on and off in turn, the order swapped every round
        for fair in ("on", "off") if number % 2 == 0 else ("off", "on"):
            await measure(args, served, fair, saturated, late)
    report(table, args, saturated, late)
    seconds = time.perf_counter() - started
    print(f"{seconds:.0f} s in all")
    print()
    print(table.render())
    if args.json:
        figures = {**host(), "command": " ".join(["python -m bench.fairshare", *sys.argv[1:]]), "model": spec.id,
                   "slots": args.streams, **{name: getattr(args, name) for name in
                                             ("streams", "tokens", "seconds", "warm_up", "backlog", "late",
                                              "rounds", "one_stack")}, "run_seconds": round(seconds),
                   "table": [dict(zip(("measure", "on", "off", "ratio", "target"), row, strict=True))
                             for row in table.rows],
                   "saturated": [asdict(run) for run in saturated], "late_comer": [asdict(run) for run in late]}
        args.json.write_text(json.dumps(rounded(figures), indent=1) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random", help="served with --streams slots")
    parser.add_argument("--streams", type=int, default=16, help="tasks kept busy by the one principal")
    parser.add_argument("--tokens", type=int, default=16, help="max_output_tokens of every task")
    parser.add_argument("--seconds", type=float, default=10.0, help="the window measured with one principal")
    parser.add_argument("--backlog", type=int, default=200, help="tasks principal A queues")
    parser.add_argument("--late", type=int, default=5, help="tasks principal B queues after them")
    parser.add_argument("--rounds", type=int, default=5, help="pairs of fresh stacks, fair share on and off")
    parser.add_argument("--warm-up", type=float, default=2.0, help="seconds of load before the window")
    parser.add_argument("--one-stack", action="store_true",
                        help="both measurements of a setting on one stack with bearer tokens (the one principal: A)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warm_up, args.backlog, args.late, args.rounds = 1.0, 0.5, 16, 2, 1
        args.one_stack = True
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
