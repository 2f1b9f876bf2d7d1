"""The engine alone, in process: one stream's tokens/s and time to first token, the aggregate tokens/s of
N concurrent streams, and the engine's warm-up, eager and compiled, beside raw transformers ``generate``
on the same weights in the same run. This is the model step without the service around it (which costs
about 1% at one stream on a CPU: bench.throughput); it is the GPU run of docs/performance.md:

    python -m bench.engine --model llama-8b-random --streams 1 64 --tokens 256 --compile on \
        --launch-ahead both --json gpu.json

Every stream runs to its budget (no stop tokens), greedy, from its own prompt. ``--weights both`` runs
each setting on the dense weights and on the 4-bit ones (a CPU; ``weights.pack_int4``); on a CPU the
4-bit decoding's greedy answer to the README prompt is checked against the float32 model's.
``--launch-ahead both`` runs each setting with decoding steps run one at a time and launched ahead
(``workers.engine.scheduler``; the engine's default: ahead on a GPU only). ``--logprobs K`` also runs
every stream count asking for log-probabilities with K alternatives a token, interleaved, and prints
its ratio to the same count without.
"""

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from lmsp_core import wire
from lmsp_core.requests.catalog import Catalog
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import load_settings
from workers.engine.core import Engine, Generation
from workers.engine.sampling import RowSampler, SamplingParams, Scores
from workers.model import loader
from workers.model.build import slot_model
from workers.model.decoder import Decoder
from workers.model.plan import Chunk, Feed, StepPlan

README_PROMPT = "Describe a local model service in one sentence."  # README, "Try it"


class Timing:
    """A sink that notes when each sequence got its first token and when it finished."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.tokens = 0
        self.done = asyncio.Event()

    def on_token(self, seq: Generation, token: int, scores: Scores | None) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.tokens += 1

    def on_finish(self, seq: Generation, reason: str, error: BaseException | None) -> None:
        if error is not None:
            raise RuntimeError(f"a sequence failed: {error!r}")
        self.done.set()


class Arrivals(Timing):
    """A sink that keeps each token and when it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[int] = []
        self.times: list[float] = []

    def on_token(self, seq: Generation, token: int, scores: Scores | None) -> None:
        super().on_token(seq, token, scores)
        self.ids.append(token)
        self.times.append(time.perf_counter())


async def long_generation(spec: Any, cache: Path, prompt: list[int], tokens: int,
                          kernel: bool = True) -> tuple[float, float]:
    """tokens/s over the first 100 and the last 100 tokens of one ``tokens``-token greedy generation
    (no stop tokens: it runs to its budget), on an engine of its own; without ``kernel``, decoding
    rows attend through torch rather than ``workers/model/cpu/kernels.c`` (the baseline of that kernel)."""
    engine = Engine(loader.load(spec, cache))
    runner = asyncio.create_task(engine.run())
    try:
        await engine.ready()
        if not kernel and isinstance(engine.model, Decoder):
            engine.model.attention = None
        sink = Arrivals()
        engine.submit(Generation(prompt, tokens, RowSampler(SamplingParams()), [], sink))
        await sink.done.wait()
    finally:
        runner.cancel()
        engine.close()
    times = sink.times
    return 99 / (times[99] - times[0]), 99 / (times[-1] - times[-100])


@dataclasses.dataclass(frozen=True)
class PairedSteps:
    """One-row decoding steps at two positions of one slot, and reading their bytes alone."""

    short_ms: float
    long_ms: float
    short_bytes: int  # what each step reads (``Decoder.step_bytes``)
    long_bytes: int
    short_read_ms: float  # reading as many bytes alone, one thread (``read_ms``)
    long_read_ms: float


def paired_steps(spec: Any, cache: Path, short: int, long: int, steps: int, block: int = 50) -> PairedSteps | None:
    """Milliseconds of a one-row decoding step at position ``short`` and at ``long`` of one slot (its
    keys and values written once, up to ``long``), medians of ``steps`` each, run in blocks of
    ``block`` steps at one position then the other: what the long generation's ratio measures,
    without the VM's drift over the seconds between a generation's first and last tokens. Blocks,
    not single steps: a step right after one at 1,500 positions runs slower than one after its like
    (SmolLM2 on the Zen 4 EPYC, in the same run: single steps alternating read 0.83-0.85, blocks of 100
    0.77-0.83, a generation's own measure 0.73-0.82; docs/performance.md). Between the blocks, as many
    bytes as each step reads are read alone, from one buffer as large as the longer step's
    (``read_ms``): what a step bound by its reads would take at one thread's pace. None where the
    model does not run on the slot decoder."""
    loaded = loader.load(spec, cache)
    model = slot_model(loaded, compile=False)
    if not isinstance(model, Decoder) or long >= loaded.spec.context_window:
        return None
    tokens = torch.randint(3, model.vocab, (long + 1,), generator=torch.Generator().manual_seed(long)).tolist()
    times: dict[int, list[float]] = {short: [], long: []}
    reads: dict[int, list[float]] = {short: [], long: []}
    sizes = {position: model.step_bytes(position) for position in (short, long)}
    words = torch.ones(sizes[long] // 8, dtype=torch.int64).numpy().view(np.uint64)  # torch's memory, as a step's
    with torch.inference_mode():
        for start in range(0, long, 256):
            end = min(long, start + 256)
            model.run(StepPlan(chunks=[Chunk(0, start, tokens[start:end], end == long)]))
        while len(times[long]) < steps:
            for position in (short, long):
                for _ in range(min(block, steps - len(times[position]))):
                    started = time.perf_counter()
                    model.run(StepPlan(feeds=[Feed(0, tokens[position], position)]))
                    times[position].append(time.perf_counter() - started)
            for position in (short, long):
                reads[position] += read_ms(words[:sizes[position] // 8], block // 5 or 1)
    return PairedSteps(statistics.median(times[short]) * 1000, statistics.median(times[long]) * 1000,
                       sizes[short], sizes[long], statistics.median(reads[short]), statistics.median(reads[long]))


def read_ms(words: np.ndarray, times: int) -> list[float]:
    """Milliseconds to read ``words`` once, ``times`` times over, on this thread: numpy's maximum of
    64-bit words reads as fast as a C loop of AVX512 loads (26-27 GB/s from 98 MB on the AMX Xeon)."""
    taken = []
    for _ in range(times):
        started = time.perf_counter()
        words.max()
        taken.append((time.perf_counter() - started) * 1000)
    return taken


async def first_token_seconds(spec: Any, cache: Path, prompt: list[int], samples: int) -> float:
    """Seconds to the first token of ``prompt`` (p50 of ``samples``) from nothing: on an engine of its
    own that reuses no prefix."""
    engine = Engine(loader.load(msgspec.structs.replace(spec, reuse_prefixes=False), cache))
    runner = asyncio.create_task(engine.run())
    firsts = []
    try:
        await engine.ready()
        for _ in range(samples):
            sink, started = Timing(), time.perf_counter()
            engine.submit(Generation(prompt, 1, RowSampler(SamplingParams()), [], sink))
            await sink.done.wait()
            firsts.append((sink.first or started) - started)
    finally:
        runner.cancel()
        engine.close()
    return statistics.median(firsts)


async def greedy_answer(loaded: loader.LoadedModel, prompt: list[int], tokens: int) -> list[int]:
    """The greedy tokens of one generation (to a stop token or ``tokens``), on an eager engine of its own."""
    engine = Engine(loaded, compile=False)
    runner = asyncio.create_task(engine.run())
    try:
        await engine.ready()
        sink = Arrivals()
        engine.submit(Generation(prompt, tokens, RowSampler(SamplingParams()), loaded.card.stop_token_ids, sink))
        await sink.done.wait()
        return sink.ids
    finally:
        runner.cancel()
        engine.close()


async def same_text(loaded: loader.LoadedModel, cache: Path, prompt: list[int], tokens: int = 256) -> str:
    """Whether the model as loaded (4-bit decoding where it packs, its cache's dtype) answers ``prompt``
    as the float32 model with dense weights and a float32 cache does, greedy."""
    exact = loader.load(msgspec.structs.replace(loaded.spec, dtype="float32", weights="dense", kv_dtype="float32"),
                        cache)
    expected = await greedy_answer(exact, prompt, tokens)
    got = await greedy_answer(weights_variant(loaded, "auto"), prompt, tokens)
    if got == expected:
        return f"same as the float32 model's ({len(got)} tokens)"
    differ = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                  min(len(got), len(expected)))
    return f"DIFFERS from the float32 model's at token {differ + 1} of {len(expected)}"


def weights_variant(loaded: loader.LoadedModel, weights: str) -> loader.LoadedModel:
    """The loaded model for an engine of its own: its 4-bit packing as loaded (``auto``) or none."""
    if weights == "dense":
        return dataclasses.replace(loaded, exact_weights={}, int4_rows=0)
    return dataclasses.replace(loaded, exact_weights=dict(loaded.exact_weights))  # an engine clears its copy


def user_message(text: str) -> wire.Message:
    return msgspec.convert({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
                           wire.Message)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.partition(':')[2].strip()}, {os.cpu_count()} CPUs"
    return platform.machine()


async def streams(engine: Engine, prompts: list[list[int]], tokens: int,
                  logprobs: int | None = None) -> dict[str, float]:
    """``len(prompts)`` sequences at once (each asking for ``logprobs`` alternatives, where given);
    aggregate tokens/s, TTFT p50 and the decode rate of one stream."""
    started = time.perf_counter()
    sinks = [Timing() for _ in prompts]
    for prompt, sink in zip(prompts, sinks, strict=True):
        engine.submit(Generation(prompt, tokens, RowSampler(SamplingParams(logprobs=logprobs)), [], sink))
    await asyncio.gather(*(sink.done.wait() for sink in sinks))
    seconds = time.perf_counter() - started
    total = sum(sink.tokens for sink in sinks)
    assert total == tokens * len(prompts), f"{total} tokens, not {len(prompts)} x {tokens}"
    ttfts = [(sink.first or started) - started for sink in sinks]
    after_first = seconds - max(ttfts)
    return {"tokens_per_s": total / seconds, "ttft_ms": statistics.median(ttfts) * 1000,
            "decode_tokens_per_s_per_stream": (tokens - 1) / after_first if after_first > 0 else 0.0}


def generate_rate(loaded: loader.LoadedModel, prompt: list[int], tokens: int) -> float:
    """Raw transformers ``generate`` (eager, dynamic cache), one stream: the baseline."""
    ids = torch.tensor([prompt], device=loaded.device)
    with torch.inference_mode():
        loaded.model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        sync(loaded.device)
        started = time.perf_counter()
        loaded.model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        sync(loaded.device)
    return tokens / (time.perf_counter() - started)


async def profile(engine: Engine, prompt: list[int], device: torch.device) -> None:
    """Where one stream's 32 steps spend their time, by operator (device time on a GPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with torch.profiler.profile(activities=activities) as profiler:
        done = Timing()
        engine.submit(Generation(prompt, 32, RowSampler(SamplingParams()), [], done))
        await done.done.wait()
    print(profiler.key_averages().table(sort_by=sort, row_limit=20), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def measure(loaded: loader.LoadedModel, prompts: list[list[int]], args: argparse.Namespace,
                  compile: bool, weights: str, launch_ahead: bool | None) -> dict[str, Any]:
    """Warm an engine up, run each stream count ``args.rounds`` times (best round kept), close it."""
    started = time.perf_counter()
    engine = Engine(weights_variant(loaded, weights), compile=compile, launch_ahead=launch_ahead)
    runner = asyncio.create_task(engine.run())
    try:
        await engine.ready()
        result: dict[str, Any] = {"compile": compile, "weights": weights, "launch_ahead": engine.launch_ahead,
                                  "warm_up_s": time.perf_counter() - started}
        print(f"  {mode_name(compile, weights, engine.launch_ahead)}: warmed up in {result['warm_up_s']:.1f} s",
              flush=True)
        for count in args.streams:
            rounds, scored = [], []
            for _ in range(args.rounds):  # with log-probabilities interleaved: the same moments of the VM
                rounds.append(await streams(engine, prompts[:count], args.tokens))
                if args.logprobs is not None:
                    scored.append(await streams(engine, prompts[:count], args.tokens, args.logprobs))
            best = max(rounds, key=lambda r: r["tokens_per_s"])
            result[f"streams_{count}"] = best
            print(f"  {count:>3} streams: {best['tokens_per_s']:8.1f} tokens/s, TTFT p50 {best['ttft_ms']:6.1f} ms, "
                  f"{best['decode_tokens_per_s_per_stream']:6.1f} tokens/s per stream after it", flush=True)
            if scored:
                top = max(scored, key=lambda r: r["tokens_per_s"])
                result[f"streams_{count}_logprobs_{args.logprobs}"] = top
                print(f"      with {args.logprobs} log-probabilities a token: {top['tokens_per_s']:8.1f} tokens/s "
                      f"({top['tokens_per_s'] / best['tokens_per_s']:.3f} of without)", flush=True)
        if args.profile:
            await profile(engine, prompts[0], loaded.device)
        return result
    finally:
        runner.cancel()
        engine.close()
        del engine
        gc.collect()
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()


def mode_name(compile: bool, weights: str, launch_ahead: bool | None) -> str:
    ahead = "" if launch_ahead is None else ", steps launched ahead" if launch_ahead else ", steps one at a time"
    return f"{'compiled' if compile else 'eager'}, {weights} weights{ahead}"


async def main(args: argparse.Namespace) -> None:
    settings = load_settings()
    loader.limit_threads(settings.torch_threads, settings.attention_helper)
    spec = Catalog.from_settings(settings).get(args.model)
    started = time.perf_counter()
    loaded = loader.load(spec, Path(settings.model_cache))
    renderer = PromptRenderer(loaded.card)
    prompts = [renderer.encode(renderer.render([user_message(f"Tell me about local model services, part {i}.")]))
               for i in range(max(args.streams))]
    report: dict[str, Any] = {"model": spec.id, "device": device_name(loaded.device), "dtype": str(loaded.dtype),
                              "int4_rows": loaded.int4_rows, "torch": torch.__version__, "tokens": args.tokens,
                              "load_s": time.perf_counter() - started}
    print(f"{spec.id} on {report['device']} ({report['dtype']}, 4-bit decoding products up to {loaded.int4_rows} "
          f"rows, torch {torch.__version__}), loaded in "
          f"{report['load_s']:.1f} s; {args.tokens} tokens per stream, best of {args.rounds}", flush=True)
    if args.baseline_tokens:
        report["generate_tokens_per_s"] = generate_rate(loaded, prompts[0], args.baseline_tokens)
        print(f"  transformers generate, 1 stream: {report['generate_tokens_per_s']:.1f} tokens/s", flush=True)
    modes = {"auto": [loaded.device.type == "cuda"], "on": [True], "off": [False], "both": [False, True]}
    ahead_modes: dict[str, list[bool | None]] = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}
    aheads = ahead_modes[args.launch_ahead]
    report["runs"] = []
    for weights in {"auto": ["auto"], "dense": ["dense"], "both": ["dense", "auto"]}[args.weights]:
        for compile in modes[args.compile]:
            for ahead in aheads:
                try:
                    report["runs"].append(await measure(loaded, prompts, args, compile, weights, ahead))
                except Exception as exc:  # report what failed and go on with the next mode
                    print(f"  {mode_name(compile, weights, ahead)}: FAILED {exc!r}", flush=True)
                    report["runs"].append({"compile": compile, "weights": weights, "launch_ahead": ahead,
                                           "error": repr(exc)})
                if args.json:
                    Path(args.json).write_text(json.dumps(report, indent=2))
    if loaded.int4_rows and loaded.exact_weights:
        report["readme_answer"] = await same_text(loaded, Path(settings.model_cache),
                                                  renderer.encode(renderer.render([user_message(README_PROMPT)])))
        print(f"  4-bit decoding, greedy answer to the README prompt: {report['readme_answer']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m-instruct")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", choices=["auto", "on", "off", "both"], default="both")
    parser.add_argument("--launch-ahead", choices=["auto", "on", "off", "both"], default="auto",
                        help="decoding steps launched before the last one's tokens are read (auto: on a GPU)")
    parser.add_argument("--weights", choices=["auto", "dense", "both"], default="auto",
                        help="decoding weights: as loaded (4-bit where they pack), dense, or each in turn")
    parser.add_argument("--baseline-tokens", type=int, default=32, help="0: skip transformers generate")
    parser.add_argument("--profile", action="store_true", help="also profile one stream's steps")
    parser.add_argument("--logprobs", type=int, metavar="K",
                        help="also run every stream count asking for log-probabilities and K alternatives a token")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
