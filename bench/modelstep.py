"""What the model step costs, measured through the service: one stream against llama.cpp on the same
GGUF file and thread count, running streams while a long prompt joins, and a worker's cold start and
warm restart (its model and compile caches). A long generation's last tokens against its first are
measured on the engine in process (``bench.engine.long_generation``).
"""

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import engine
from bench.report import Measured, Table, percentile, prompt_text, ratio, user_input
from bench.sse import SseStream
from bench.stack import Stack
from lmsp_core import wire
from lmsp_core.requests import modelfiles
from lmsp_core.settings import load_settings

HOST = "127.0.0.1"
LONG_PROMPT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships along dangerous "
               "coasts, and continues through towers of stone, oil lamps, clockwork lenses and electric beams. ")
COUNTING = "Count from 1 to 2000, one number per line, without stopping."


async def delta_times(port: int, model: str, text: str, max_tokens: int,
                      started: asyncio.Event | None = None) -> list[float]:
    """Arrival times of a streamed response's text deltas (about one per token)."""
    body = json.dumps({"model": model, "input": user_input(text), "stream": True, "max_output_tokens": max_tokens,
                       "temperature": 0}).encode()
    times: list[float] = []
    async for arrived, events in SseStream(HOST, port, "POST", "/lmsp/v1/responses", body).batches():
        times += [arrived for event in events if event.name == wire.TEXT_DELTA]
        if started is not None and len(times) >= 20:
            started.set()
    return times


# --- llama.cpp -------------------------------------------------------------------------------------


def llama_cpp_rates(spec: Any, cache: Path, prompt: list[int], tokens: int, threads: int,
                    repeat: int) -> tuple[float, float] | None:
    """llama.cpp's tokens/s (end to end, as ours) and time to first token on the model's GGUF file,
    with ``threads`` threads; None when llama-cpp-python is not installed or the model has no GGUF."""
    try:
        import llama_cpp
    except ImportError:
        return None
    kind, _, location = spec.source.partition(":")
    if kind != "gguf-package":
        return None
    llm = llama_cpp.Llama(model_path=str(modelfiles.package_file(location)), n_threads=threads, n_threads_batch=threads,
                          n_ctx=4096, verbose=False)
    rates, firsts = [], []
    for _ in range(repeat):
        llm.reset()  # no prompt cache: the prompt is evaluated each time, as ours is
        start = time.perf_counter()
        first, count = 0.0, 0
        for _token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            count += 1
            first = first or time.perf_counter() - start
            if count == tokens:
                break
        rates.append(count / (time.perf_counter() - start))
        firsts.append(first)
    llm.close()
    return statistics.median(rates), statistics.median(firsts)


# --- a long prompt joining ---------------------------------------------------------------------------


async def joining_prompt(port: int, model: str, prompt_text: str, streams: int = 8) -> tuple[float, float, float]:
    """Inter-token delays of ``streams`` running streams: median while no prompt joins, p99 and max
    while a long prompt joins (from its request to its first token)."""
    started = [asyncio.Event() for _ in range(streams)]
    running = [asyncio.create_task(delta_times(port, model, COUNTING, 400, started[i])) for i in range(streams)]
    await asyncio.gather(*(event.wait() for event in started))
    join_start = time.perf_counter()
    joined = await delta_times(port, model, prompt_text, 1)
    join_end = joined[0] if joined else time.perf_counter()
    results = await asyncio.gather(*running)
    pairs = [(a, b) for times in results for a, b in itertools.pairwise(times)]
    during = [b - a for a, b in pairs if b >= join_start and a <= join_end]
    apart = [b - a for a, b in pairs if b < join_start or a > join_end]
    return statistics.median(apart), percentile(during, 99), max(during)


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
    theirs = llama_cpp_rates(local.loaded.spec, Path(load_settings().model_cache), prompt, args.tokens,
                                       threads, args.repeat)
    if theirs is None:
        table.add("1 stream: vs llama.cpp", "not installed (see docs/performance.md)")
    else:
        rate, first = theirs
        table.add(f"1 stream: vs llama.cpp ({threads} threads, same GGUF)", f"{measured.single:.1f}",
                  f"{rate:.1f} llama.cpp", ratio(measured.single, rate), ">= 0.8")
        table.add("1 stream: TTFT p50 vs llama.cpp", f"{measured.ttft_ms:.1f} ms", f"{first * 1000:.1f} ms",
                  "", "<= 60 ms")
    # in process, on an engine of its own: through the service the model ends its answer first
    first_rate, last_rate = await engine.long_generation(local.loaded.spec, Path(load_settings().model_cache),
                                                         prompt, args.long_tokens)
    table.add(f"long generation ({args.long_tokens} tokens, engine): tokens/s at the last 100 / first 100",
              f"{last_rate:.1f}", f"{first_rate:.1f}", ratio(last_rate, first_rate), ">= 0.9")
    text = long_prompt_text(local, args.long_tokens)
    median, p99, worst = await joining_prompt(stack.api_port, args.model, text)
    table.add(f"8 streams, a {len(local.prompt(text))}-token prompt joins: inter-token delay p99 (max) / median apart",
              f"{p99 * 1000:.0f} ({worst * 1000:.0f}) ms", f"{median * 1000:.0f} ms", f"{p99 / median:.1f}x", "<= 2x")


def startup(models: list[dict[str, Any]], spec: Any, threads: int, table: Table) -> None:
    """A worker's first start (an empty model cache: converting, compiling) and its restart (both cached)."""
    with tempfile.TemporaryDirectory(prefix="lmsp-model-cache-") as cache:
        cold = startup_seconds(models, spec.id, threads, Path(cache))
        warm = startup_seconds(models, spec.id, threads, Path(cache))
    table.add(f"worker start (compile={spec.compile}): first / restart", f"{cold:.0f} s",
              f"{warm:.0f} s", "", "restart <= 20 s")
