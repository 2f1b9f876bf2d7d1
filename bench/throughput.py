"""What the service costs on top of the model: throughput, latency, fan-out, resume and storage.

Starts its own redis-server, API and worker, loads the same model in this process as the baseline,
and prints one table of figures and ratios measured in this run:

1. one stream: tokens/s through HTTP SSE vs in-process ``model.generate`` (same prompt, greedy),
   and time to first token through the service minus in-process;
2. 1, 4, 16 and 64 concurrent streams: aggregate tokens/s vs in-process batched ``generate`` of the
   same requests (and vs ``transformers serve --continuous-batching`` when it is installed);
3. fan-out: 1,000 SSE readers of one task (this process writes its events through the worker's
   writer at a steady rate): gaps, write-to-receipt delay p50/p99, API CPU per 1,000 events;
4. resume: reconnect with Last-Event-ID to the first replayed event, p50/p99;
5. Redis bytes per stored event, API memory per idle open stream.

    python -m bench.throughput [--model smollm2:135m-instruct] [--tokens 128] [--streams 1 4 16 64]
                               [--readers 1000] [--quick]
    python -m bench.throughput --replication [--streams 1 4 16] [--rounds 5]: instead, what acknowledging
        events on a replica costs (a primary with one replica; WAIT 1 after each flush vs none), and
        the same with the replica killed

On a GPU it runs as it is; ``--model llama-8b-random`` is the 8B Llama shape with random weights.
"""

import argparse
import asyncio
import contextlib
import gc
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
import torch

from bench import hfserve, modelstep
from bench.replication import replication
from bench.report import Measured, Table, fresh_prompt_text, percentile, prompt_text, ratio, user_input
from bench.sse import HOST, EventIdReader, SseStream, concurrent_streams, stream_response
from bench.stack import Stack, cpu_seconds, rss_bytes
from bench.tasks import UNSERVED, claim_task, create_task
from lmsp_core import wire
from lmsp_core.requests.catalog import Catalog
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import Settings, load_settings
from lmsp_core.store import keys
from lmsp_core.store.tasks.eventstore import Final
from workers.model import loader

# --- in process ----------------------------------------------------------------------------------


class InProcess:
    """The same model loaded here, driven by plain transformers."""

    def __init__(self, spec: Any, cache: Path) -> None:
        self.loaded = loader.load(spec, cache)
        self.renderer = PromptRenderer(self.loaded.card)
        self.stop_ids = set(self.loaded.card.stop_token_ids)

    def prompt(self, text: str) -> list[int]:
        request = msgspec.convert({"model": self.loaded.spec.id, "input": user_input(text)}, wire.ResponseRequest)
        return self.renderer.prompt_ids(request)

    def generate(self, prompts: list[list[int]], max_new: int) -> tuple[int, float]:
        """Greedy batched generation; (tokens up to each row's first stop token, seconds)."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        device = self.loaded.device
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.loaded.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new, do_sample=False,
                temperature=None, top_p=None, top_k=None, eos_token_id=sorted(self.stop_ids),
                pad_token_id=self.loaded.card.stop_token_ids[0])
        self._sync()
        seconds = time.perf_counter() - start
        return sum(self._length(row[width:].tolist()) for row in out), seconds

    def _length(self, generated: list[int]) -> int:
        for i, token in enumerate(generated):
            if token in self.stop_ids:
                return i + 1
        return len(generated)

    def _sync(self) -> None:
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize()


# --- fan-out, resume ------------------------------------------------------------------------------


async def write_events(stack: Stack, settings: Settings, task: dict[str, Any], count: int,
                       rate: float) -> dict[int, float]:
    """Claim the task as a worker would and append ``count`` deltas at ``rate`` per second, then the
    final event; returns when each event number was handed to Redis."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    record, writer, run = await claim_task(redis, settings, task["id"], "bench/fan-out")
    written: dict[int, float] = {}
    rid = record.response_id
    item = "msg_bench0000000000000000000000"
    start = time.perf_counter()
    for i in range(count + 1):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        written_at = time.perf_counter()
        if i == 0:
            number = writer.event(run, wire.CREATED, wire.ResponseCreated(response_id=rid))
        else:
            delta = wire.OutputTextDelta(response_id=rid, item_id=item, delta=f" word{i}")
            number = writer.event(run, wire.TEXT_DELTA, delta)
        assert number is not None, "the benchmark's own log was closed"
        written[number] = written_at
        await writer.flush()
    usage = wire.Usage(input_tokens=1, output_tokens=count, total_tokens=count + 1)
    number = writer.event(run, wire.COMPLETED, wire.ResponseCompleted(response_id=rid, status="completed", usage=usage))
    assert number is not None, "the benchmark's own log was closed"
    written[number] = time.perf_counter()
    response = wire.Response(id=rid, created_at=int(record.created_at), status="completed", model=UNSERVED, output=[],
                             usage=usage)
    writer.finalize(run, Final("completed", wire.encoder.encode(response)))
    await writer.flush()
    await redis.aclose()
    return written


async def fan_out(stack: Stack, table: Table, readers: int, events: int, rate: float) -> str:
    settings = Settings(redis_url=stack.redis_url)
    task = await create_task(stack.api_port)
    api_pid = stack.api.pid
    rss_before = rss_bytes(api_pid)
    request = (f"GET /lmsp/v1/tasks/{task['id']}/events HTTP/1.1\r\nHost: {HOST}\r\n"
               "Accept: text/event-stream\r\n\r\n").encode()
    loop = asyncio.get_running_loop()
    # the collector's pauses in this process (a thousand readers' objects) would count as delivery
    # delay: the readers run with it off
    gc.collect()
    gc.disable()
    followers = [EventIdReader(request) for _ in range(readers)]
    for wave in range(0, readers, 100):
        for follower in followers[wave:wave + 100]:
            await loop.create_connection(lambda f=follower: f, HOST, stack.api_port)  # type: ignore[misc]
        await asyncio.gather(*(f.ready for f in followers[wave:wave + 100]))
    await asyncio.sleep(1.0)
    rss_idle = rss_bytes(api_pid)
    cpu_start = cpu_seconds(api_pid)
    written = await write_events(stack, settings, task, events, rate)
    await asyncio.gather(*(f.done for f in followers))
    cpu = cpu_seconds(api_pid) - cpu_start
    gc.enable()
    delays = [(f.arrivals[n] - written[n]) * 1000 for f in followers for n in written if n in f.arrivals]
    expected = sorted(written)
    gapless = sum(f.ids == expected for f in followers)
    delivered = sum(len(f.ids) for f in followers)
    table.add(f"fan-out: {readers} readers x {len(expected)} events, gapless", f"{gapless}/{readers}",
              target=f"{readers}/{readers}")
    table.add("fan-out: write-to-receipt delay p50 / p99", f"{percentile(delays, 50):.1f} / "
              f"{percentile(delays, 99):.1f} ms", target="p99 <= 100 ms")
    table.add("fan-out: API CPU per 1,000 delivered events", f"{cpu / delivered * 1000 * 1000:.1f} ms")
    table.add("API memory per idle open stream", f"{(rss_idle - rss_before) / readers / 1024:.1f} KiB")
    return str(task["id"])


async def resume(stack: Stack, table: Table, task_id: str, events: int, count: int) -> None:
    waits = []
    for _ in range(count):
        after = random.randint(1, events - 1)
        stream = SseStream(HOST, stack.api_port, "GET", f"/lmsp/v1/tasks/{task_id}/events",
                           headers={"Last-Event-ID": str(after)})
        start = time.perf_counter()
        async with contextlib.aclosing(stream.batches()) as batches:  # closes the connection
            async for arrived, batch in batches:
                if any(e.id == after + 1 for e in batch):
                    waits.append((arrived - start) * 1000)
                    break
    table.add("resume: Last-Event-ID to first replayed event p50 / p99",
              f"{percentile(waits, 50):.1f} / {percentile(waits, 99):.1f} ms")


async def storage(stack: Stack, table: Table) -> None:
    redis = aioredis.Redis.from_url(stack.redis_url)
    stream_bytes = checkpoint_bytes = entries = 0
    async for key in redis.scan_iter(match=keys.events("*")):
        task_id = key.decode().split("{")[1].split("}")[0]
        record = await redis.hget(keys.task(task_id), "model")
        if record is None or record.decode() == UNSERVED:
            continue  # only tasks the worker generated
        stream_bytes += await redis.memory_usage(key, samples=0) or 0
        checkpoint_bytes += await redis.memory_usage(keys.token_ids(task_id), samples=0) or 0
        entries += await redis.xlen(key)
    await redis.aclose()
    if entries:
        table.add("Redis bytes per stored event (event stream)", f"{stream_bytes / entries:.0f} B",
                  target="<= 150 B")
        table.add("  with the token checkpoint", f"{(stream_bytes + checkpoint_bytes) / entries:.0f} B")


# --- the run --------------------------------------------------------------------------------------


async def throughput(args: argparse.Namespace, stack: Stack, local: InProcess, table: Table) -> Measured:
    model = args.model
    measured = Measured()
    rates = measured.rates
    await stream_response(stack.api_port, model, prompt_text(0), 8)  # warm-up
    local.generate([local.prompt(prompt_text(0))], 8)
    prompt = local.prompt(prompt_text(0))
    service_runs, local_runs = [], []
    for _ in range(args.repeat):  # interleaved, so that a change in machine load hits both alike
        service_runs.append(await stream_response(stack.api_port, model, prompt_text(0), args.tokens))
        local_runs.append(local.generate([prompt], args.tokens))
    service_rate = statistics.median(r.tokens / r.seconds for r in service_runs)
    local_rate = statistics.median(t / s for t, s in local_runs)
    table.add("1 stream: tokens/s end to end", f"{service_rate:.1f}", f"{local_rate:.1f} generate",
              ratio(service_rate, local_rate), ">= 0.95")
    # time to first token: many short pairs (a prefill's own noise is larger than what we add)
    service_ttft, local_ttft = [], []
    for _ in range(args.ttft_samples):
        service_ttft.append((await stream_response(stack.api_port, model, prompt_text(0), 1)).ttft * 1000)
        local_ttft.append(local.generate([prompt], 1)[1] * 1000)
    added = statistics.median(s - t for s, t in zip(service_ttft, local_ttft, strict=True))
    measured.ttft_ms = statistics.median(service_ttft)
    table.add("1 stream: TTFT p50, the same prompt again (service / in-process)",
              f"{statistics.median(service_ttft):.1f} ms", f"{statistics.median(local_ttft):.1f} ms",
              f"{added:+.1f} ms", "+<= 10 ms")
    fresh = [(await stream_response(stack.api_port, model, fresh_prompt_text(i), 1)).ttft * 1000
             for i in range(args.ttft_samples)]
    measured.ttft_fresh_ms = statistics.median(fresh)
    for count in args.streams:
        prompts = [local.prompt(prompt_text(i)) for i in range(count)]
        service_rates, local_rates, gapless = [], [], True
        for _ in range(args.rounds):  # interleaved, as above: this machine's speed drifts by 20%
            tokens, seconds, round_gapless = await concurrent_streams(stack.api_port, model, count, args.tokens)
            local_tokens, local_seconds = local.generate(prompts, args.tokens)
            service_rates.append(tokens / seconds)
            local_rates.append(local_tokens / local_seconds)
            gapless = gapless and round_gapless
        rate, local_rate = statistics.median(service_rates), statistics.median(local_rates)
        row = f"{count} streams: aggregate tokens/s" + ("" if gapless else " (GAPS!)")
        table.add(row, f"{rate:.1f}", f"{local_rate:.1f} batched generate", ratio(rate, local_rate),
                  ">= 0.9" if count == 16 else "")
        rates[count] = rate
        if count == 16 and local.loaded.dtype != torch.float32:
            float32_baseline(args, local, prompts, rate, table)
    return measured


def float32_baseline(args: argparse.Namespace, local: InProcess, prompts: list[list[int]], rate: float,
                     table: Table) -> None:
    """The same streams against float32 batched ``generate``: what the engine before issue 14 (the eager
    float32 transformers path, level with it) did, so that its 2x target reads in the same run where
    the model runs in bfloat16 and the batched baseline above does too."""
    exact = InProcess(msgspec.structs.replace(local.loaded.spec, dtype="float32", weights="dense"),
                      Path(load_settings().model_cache))
    runs = [exact.generate(prompts, args.tokens) for _ in range(args.rounds)]
    baseline = statistics.median(tokens / seconds for tokens, seconds in runs)
    table.add(f"{len(prompts)} streams: vs the float32 eager path", f"{rate:.1f}",
              f"{baseline:.1f} batched generate, float32", ratio(rate, baseline), ">= 2")


async def versus_hf_serve(args: argparse.Namespace, local: InProcess, table: Table, rates: dict[int, float],
                          cache: Path, threads: int) -> None:
    """The same concurrent streams through ``transformers serve`` (after ours: never both at once)."""
    if not hfserve.available():
        table.add("vs transformers serve --continuous-batching", "not installed (pip install -e .[bench])")
        return
    with hfserve.HfServe(local.loaded, cache, threads) as hf:
        await hf.stream(prompt_text(0), 8)  # warm-up
        for count, rate in rates.items():
            theirs = await hf.aggregate([prompt_text(i) for i in range(count)], args.tokens)
            table.add(f"{count} streams: vs transformers serve --continuous-batching", f"{rate:.1f}",
                      f"{theirs:.1f} transformers serve", ratio(rate, theirs), "> 1" if count == 16 else "")


async def main(args: argparse.Namespace) -> None:
    settings = load_settings()
    catalog = Catalog.from_settings(settings)
    spec = catalog.get(args.model)
    threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
    table = Table()
    if args.replication:
        loader.limit_threads(threads, settings.attention_helper)
        await replication(args, spec, threads, table)
        print()
        print(table.render())
        return
    served = msgspec.structs.replace(spec, max_batch_size=max(spec.max_batch_size, *args.streams))
    unserved = msgspec.structs.replace(spec, id=UNSERVED, source="tiny-random")
    models = [msgspec.to_builtins(s) for s in (served, unserved)]
    loader.limit_threads(threads, settings.attention_helper)
    local = InProcess(spec, Path(settings.model_cache))
    with Stack(models, [spec.id], threads) as stack:
        print(f"model {spec.id} on {local.loaded.device} ({local.loaded.model.dtype}), {threads} torch threads, "
              f"{os.cpu_count()} CPUs; {args.tokens} tokens per stream, median of {args.repeat}", flush=True)
        measured = await throughput(args, stack, local, table)
        await modelstep.model_step(args, stack, local, table, measured, threads)
        task_id = await fan_out(stack, table, args.readers, args.events, args.rate)
        await resume(stack, table, task_id, args.events, args.resumes)
        await storage(stack, table)
    await versus_hf_serve(args, local, table, measured.rates, Path(settings.model_cache), threads)
    if args.startup:
        modelstep.startup(models[:1], served, threads, table)
    print()
    print(table.render())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m-instruct")
    parser.add_argument("--tokens", type=int, default=128, help="max_output_tokens of every stream")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each concurrency (median)")
    parser.add_argument("--ttft-samples", type=int, default=20, help="paired first-token measurements")
    parser.add_argument("--readers", type=int, default=1000)
    parser.add_argument("--events", type=int, default=200, help="events of the fan-out task")
    parser.add_argument("--rate", type=float, default=20.0, help="fan-out events per second")
    parser.add_argument("--resumes", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: all cores but one)")
    parser.add_argument("--long-tokens", type=int, default=1500, help="the long generation and the joining prompt")
    parser.add_argument("--long-runs", type=int, default=3,
                        help="long generations with the kernels (median ratio: a VM's speed drifts within one)")
    parser.add_argument("--long-steps", type=int, default=200,
                        help="steps at each of 100 and --long-tokens positions, in blocks of 50 alternating (the long "
                             "generation without drift)")
    parser.add_argument("--startup", action="store_true", help="also time a worker's first start and restart")
    parser.add_argument("--replication", action="store_true",
                        help="instead: the cost of acknowledging events on a replica (WAIT 1) vs the primary alone")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeat, args.streams, args.rounds, args.ttft_samples = 16, 2, [1, 4], 1, 3
        args.readers, args.events, args.rate, args.resumes = 50, 20, 50.0, 20
        args.long_tokens, args.long_runs, args.long_steps = 300, 1, 5
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
