"""What the model step costs, measured through the service: one stream against llama.cpp on the same
GGUF file and thread count, running streams while a long prompt joins, and a worker's cold start and
warm restart (its model and compile caches). A long generation's last tokens against its first are
measured on the engine in process (``bench.engine.long_generation``).
"""

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import engine
from bench.report import Measured, Table, fresh_prompt_text, percentile, prompt_text, ratio, user_input
from bench.sse import HOST, SseStream, stream_response
from bench.stack import Stack
from lmsp_core import wire
from lmsp_core.requests import modelfiles
from lmsp_core.settings import load_settings

LONG_PROMPT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships along dangerous "
               "coasts, and continues through towers of stone, oil lamps, clockwork lenses and electric beams. ")
# the running streams' request: SmolLM2's greedy answer runs on past 700 tokens, so the streams
# decode beside the whole join (a counting answer that ended at 121 tokens left them done halfway)
RUNNING = "List the numbers from 100 to 999, one per line."
AFTER_JOIN = 40  # tokens each running stream takes after the joining prompt's first token, then it leaves


async def delta_times(port: int, model: str, text: str, max_tokens: int, started: asyncio.Event | None = None,
                      enough: Callable[[list[float]], bool] | None = None) -> list[float]:
    """Arrival times of a streamed response's text deltas (about one per token), until the stream ends
    or ``enough`` says so (leaving the stream cancels its task)."""
    body = json.dumps({"model": model, "input": user_input(text), "stream": True, "max_output_tokens": max_tokens,
                       "temperature": 0}).encode()
    times: list[float] = []
    async with contextlib.aclosing(SseStream(HOST, port, "POST", "/lmsp/v1/responses", body).batches()) as batches:
        async for arrived, events in batches:
            times += [arrived for event in events if event.name == wire.TEXT_DELTA]
            if started is not None and len(times) >= 20:
                started.set()
            if enough is not None and enough(times):
                break
    return times


# --- llama.cpp -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCpp:
    """llama.cpp's one-stream tokens/s and times to first token (seconds, p50)."""

    rate: float
    ours: float  # the service's one-stream tokens/s, measured alternately with ``rate``
    first: float  # nothing cached
    first_again: float  # the same prompt again (its prompt cache holds all of it)
    first_fresh: float  # a new prompt each time (its prompt cache holds the chat template's start)


async def llama_cpp_rates(spec: Any, prompt: list[int], fresh: list[list[int]], tokens: int, threads: int,
                          repeat: int, ours: Callable[[], Awaitable[float]]) -> LlamaCpp | None:
    """llama.cpp on the model's GGUF file with ``threads`` threads: tokens/s (end to end, as ours) and
    time to first token of ``prompt`` from nothing, of ``prompt`` again and of each ``fresh`` prompt
    (llama-cpp-python keeps the longest prefix of its last context, as our slots do); None when
    llama-cpp-python is not installed or the model has no GGUF. Each of its ``repeat`` generations
    follows one of ``ours`` (the service's tokens/s): this VM's speed drifts by a fifth within minutes,
    so the two are compared run by run, not a section apart."""
    llm = _llama_cpp(spec, threads)
    if llm is None:
        return None
    runs, our_rates = [], []
    for _ in range(repeat):
        our_rates.append(await ours())
        llm.reset()  # no prompt cache: the prompt is evaluated each time
        runs.append(_llama_cpp_run(llm, prompt, tokens))
    # two tokens each, so that its context holds one generated token after the prompt, as a slot
    # does after a request (with the bare prompt it would answer from the logits it kept)
    again = [_llama_cpp_run(llm, prompt, 2)[1] for _ in range(len(fresh))]
    firsts_fresh = [_llama_cpp_run(llm, other, 2)[1] for other in fresh]
    llm.close()
    return LlamaCpp(statistics.median(rate for rate, _ in runs), statistics.median(our_rates),
                    statistics.median(first for _, first in runs), statistics.median(again),
                    statistics.median(firsts_fresh))


def llama_cpp_long(spec: Any, prompt: list[int], tokens: int, threads: int) -> tuple[float, float] | None:
    """llama.cpp's tokens/s over the first 100 and the last 100 tokens of one ``tokens``-token greedy
    generation (as ``engine.long_generation``: the same bound, reading a longer context each token);
    None where it cannot run."""
    llm = _llama_cpp(spec, threads)
    if llm is None:
        return None
    times = []
    for _token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        times.append(time.perf_counter())
        if len(times) == tokens:
            break
    llm.close()
    return 99 / (times[99] - times[0]), 99 / (times[-1] - times[-100])


def _llama_cpp(spec: Any, threads: int) -> Any:
    """llama-cpp-python on the model's GGUF file with ``threads`` threads; None when it is not installed
    or the model has no GGUF."""
    try:
        import llama_cpp
    except ImportError:
        return None
    kind, _, location = spec.source.partition(":")
    if kind != "gguf-package":
        return None
    return llama_cpp.Llama(model_path=str(modelfiles.package_file(location)), n_threads=threads,
                           n_threads_batch=threads, n_ctx=4096, verbose=False)


def _llama_cpp_run(llm: Any, prompt: list[int], tokens: int) -> tuple[float, float]:
    """Greedy tokens/s and seconds to the first token."""
    start = time.perf_counter()
    first, count = 0.0, 0
    for _token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        count += 1
        first = first or time.perf_counter() - start
        if count == tokens:
            break
    return count / (time.perf_counter() - start), first


# --- a long prompt joining ---------------------------------------------------------------------------


async def joining_prompt(port: int, model: str, prompt_text: str,
                         streams: int = 8) -> tuple[float, float, float, bool]:
    """Inter-token delays of ``streams`` running streams: median while no prompt joins (before it and
    after it), p99 and max while a long prompt joins (from its request to its first token); and
    whether every stream ran until the prompt had joined."""
    started = [asyncio.Event() for _ in range(streams)]
    join_end: float | None = None  # the joining prompt's first token

    def done(times: list[float]) -> bool:
        return join_end is not None and len(times) - bisect.bisect_right(times, join_end) >= AFTER_JOIN

    running = [asyncio.create_task(delta_times(port, model, RUNNING, 1000, started[i], done)) for i in range(streams)]
    await asyncio.gather(*(event.wait() for event in started))
    join_start = time.perf_counter()
    joined = await delta_times(port, model, prompt_text, 1)
    join_end = joined[0] if joined else time.perf_counter()
    results = await asyncio.gather(*running)
    pairs = [(a, b) for times in results for a, b in itertools.pairwise(times)]
    during = [b - a for a, b in pairs if b >= join_start and a <= join_end]
    apart = [b - a for a, b in pairs if b < join_start or a > join_end]
    covered = all(times[-1] >= join_end for times in results)
    return statistics.median(apart), percentile(during, 99), max(during), covered


def long_prompt_text(local: Any, tokens: int) -> str:
    """A user message whose rendered prompt has about ``tokens`` tokens."""
    per_copy = len(local.prompt(LONG_PROMPT * 10)) - len(local.prompt(""))
    copies = max(1, round(tokens * 10 / per_copy))
    return LONG_PROMPT * copies


# --- start-up -------------------------------------------------------------------------------------


def startup_seconds(models: list[dict[str, Any]], served: str, threads: int, model_cache: Path) -> float:
    """Seconds from starting a worker to its model being ready (converted or read from ``model_cache``,
    compiled or read from its compile cache there, warmed up)."""
    with Stack(models, [served], threads, extra_env={"LMSP_MODEL_CACHE": str(model_cache)}) as stack:
        return stack.worker_ready_seconds


# --- the table's model-step section ------------------------------------------------------------


async def model_step(args: argparse.Namespace, stack: Stack, local: Any, table: Table, measured: Measured,
                     threads: int) -> None:
    """The model step itself: against llama.cpp, over a long generation, while a long prompt joins."""
    prompt = local.prompt(prompt_text(0))
    cache = Path(load_settings().model_cache)
    fresh = [local.prompt(fresh_prompt_text(1000 + i)) for i in range(args.ttft_samples)]

    async def service_rate() -> float:
        result = await stream_response(stack.api_port, args.model, prompt_text(0), args.tokens)
        return result.tokens / result.seconds

    theirs = await llama_cpp_rates(local.loaded.spec, prompt, fresh, args.tokens, threads, args.repeat,
                                   service_rate)
    # ours from nothing: in process, on an engine of its own that reuses no prefix (what the
    # service adds to it is the paired row above)
    cold = await engine.first_token_seconds(local.loaded.spec, cache, prompt, args.ttft_samples)
    if theirs is None:
        table.add("1 stream: vs llama.cpp", "not installed (see docs/performance.md)")
    else:
        table.add(f"1 stream: vs llama.cpp ({threads} threads, same GGUF, alternating)", f"{theirs.ours:.1f}",
                  f"{theirs.rate:.1f} llama.cpp", ratio(theirs.ours, theirs.rate), ">= 0.8")
    rows = [("the same prompt again (both with their prompt caches)", measured.ttft_ms / 1000, "first_again"),
            ("a new prompt each time (the chat template's start cached)", measured.ttft_fresh_ms / 1000,
             "first_fresh"),
            ("nothing cached (our engine in process)", cold, "first")]
    for label, ours, field in rows:
        llama = "" if theirs is None else f"{getattr(theirs, field) * 1000:.1f} ms llama.cpp"
        table.add(f"1 stream: TTFT p50, {label}", f"{ours * 1000:.1f} ms", llama, "",
                  "" if field == "first" else "<= 60 ms")
    await long_and_joining(args, stack, local, table, prompt, threads)


async def long_and_joining(args: argparse.Namespace, stack: Stack, local: Any, table: Table,
                           prompt: list[int], threads: int) -> None:
    """A long generation's last tokens against its first; running streams while a long prompt joins."""
    # in process, on an engine of its own: through the service the model ends its answer first; a
    # VM's speed drifts over the seconds one takes, so the run whose ratio is the median of several
    runs = [await engine.long_generation(local.loaded.spec, Path(load_settings().model_cache), prompt,
                                         args.long_tokens) for _ in range(args.long_runs)]
    runs.sort(key=lambda rates: rates[1] / rates[0])
    first_rate, last_rate = runs[len(runs) // 2]
    table.add(f"long generation ({args.long_tokens} tokens, engine, median of {len(runs)}): tokens/s at the last "
              "100 / first 100", f"{last_rate:.1f}", f"{first_rate:.1f}", ratio(last_rate, first_rate), ">= 0.9")
    if len(runs) > 1:
        table.add("  each run's ratio", " / ".join(f"{last / first:.2f}" for first, last in runs))
    paired = engine.paired_steps(local.loaded.spec, Path(load_settings().model_cache), 100, args.long_tokens,
                                 args.long_steps)
    if paired is not None:
        table.add(f"  one step at 100 / {args.long_tokens} positions ({args.long_steps} each, in alternating blocks)",
                  f"{paired.long_ms:.2f} ms", f"{paired.short_ms:.2f} ms", ratio(paired.short_ms, paired.long_ms))
        # what a step bound by reading its weights and cache would take, whatever its code
        megabytes = f"{paired.short_bytes / 1e6:.1f} / {paired.long_bytes / 1e6:.1f} MB"
        table.add(f"  reading those steps' bytes alone ({megabytes}, one thread)",
                  f"{paired.long_read_ms:.2f} ms", f"{paired.short_read_ms:.2f} ms",
                  ratio(paired.short_read_ms, paired.long_read_ms))
    first_rate, last_rate = await engine.long_generation(local.loaded.spec, Path(load_settings().model_cache),
                                                         prompt, args.long_tokens, kernel=False)
    table.add("  the same with torch's attention for decoding rows (not kernels.c)", f"{last_rate:.1f}",
              f"{first_rate:.1f}", ratio(last_rate, first_rate))
    theirs = llama_cpp_long(local.loaded.spec, prompt, args.long_tokens, threads)
    if theirs is not None:
        table.add("  llama.cpp, the same generation (same GGUF and threads)", f"{theirs[1]:.1f}", f"{theirs[0]:.1f}",
                  ratio(theirs[1], theirs[0]))
    text = long_prompt_text(local, args.long_tokens)
    labels = (f"8 streams, a {len(local.prompt(text))}-token prompt joins: inter-token delay p99 (max) / median apart",
              # its slot holds the first one's keys and values, which are moved aside first
              "  then another long prompt (the slot it takes holds the first one's prefix)")
    for label, joining in zip(labels, (text, "Another question. " + text), strict=True):
        median, p99, worst, covered = await joining_prompt(stack.api_port, args.model, joining)
        label += "" if covered else " (STREAMS ENDED DURING THE JOIN)"
        table.add(label, f"{p99 * 1000:.0f} ({worst * 1000:.0f}) ms", f"{median * 1000:.0f} ms",
                  f"{p99 / median:.1f}x", "<= 2x")


def startup(models: list[dict[str, Any]], spec: Any, threads: int, table: Table) -> None:
    """A worker's first start (an empty model cache: converting, compiling) and its restart (both cached)."""
    with tempfile.TemporaryDirectory(prefix="lmsp-model-cache-") as cache:
        cold = startup_seconds(models, spec.id, threads, Path(cache))
        warm = startup_seconds(models, spec.id, threads, Path(cache))
    table.add(f"worker start (compile={spec.compile}): first / restart", f"{cold:.0f} s",
              f"{warm:.0f} s", "", "restart <= 20 s")
