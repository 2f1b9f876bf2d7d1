"""Per-token cost of grammar-constrained decoding against unconstrained decoding, in process.

The same model, prompts, batch sizes and token budgets run through the worker's engine three times:
free text, a json_schema grammar and a forced tool call grammar. Every sequence runs to its budget
(the schemas allow long strings), so tokens/s compare like with like.

    python -m bench.constrained [--model smollm2:135m-instruct] [--tokens 64] [--batch 1 8] [--repeat 3]
"""

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import msgspec
from llguidance import LLTokenizer

from lmsp_core import grammars, wire
from lmsp_core.catalog import Catalog
from lmsp_core.chat import PromptRenderer
from lmsp_core.settings import load_settings
from workers import loader
from workers.engine import Engine, Sequence
from workers.grammar import GrammarConstraint, tokenizer_for
from workers.sampling import RowSampler, SamplingParams

LONG_TEXT = {"type": "string", "maxLength": 100000}
CASES: dict[str, dict[str, object]] = {
    "unconstrained": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": {
        "type": "object", "properties": {"title": LONG_TEXT, "body": LONG_TEXT}, "required": ["title", "body"]}}}},
    "tool call": {"tool_choice": "required", "tools": [{"type": "function", "name": "write", "parameters": {
        "type": "object", "properties": {"text": LONG_TEXT}, "required": ["text"]}}]},
}


class Done:
    def __init__(self) -> None:
        self.tokens = 0
        self.event = asyncio.Event()

    def on_token(self, seq: Sequence, token: int) -> None:
        self.tokens += 1

    def on_finish(self, seq: Sequence, reason: str, error: BaseException | None) -> None:
        self.event.set()


async def run_batch(engine: Engine, loaded: loader.LoadedModel, renderer: PromptRenderer, lltok: LLTokenizer,
                    case: dict[str, object], batch: int, budget: int) -> tuple[int, float]:
    sinks = []
    start = time.perf_counter()
    for i in range(batch):
        request = msgspec.convert({"model": loaded.spec.id, "input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": f"Write a long article, number {i}."}]}], **case}, wire.ResponseRequest)
        grammar = grammars.generation_grammar(request)
        constraint = GrammarConstraint(lltok, grammar) if grammar else None
        sink = Done()
        sinks.append(sink)
        # no stop tokens: every sequence runs to its budget
        engine.submit(Sequence(renderer.prompt_ids(request), budget, RowSampler(SamplingParams(), constraint), [],
                               sink))
    await asyncio.gather(*(sink.event.wait() for sink in sinks))
    return sum(sink.tokens for sink in sinks), time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    settings = load_settings()
    spec = Catalog.from_settings(settings).get(args.model)
    loaded = loader.load(spec, Path(settings.model_cache))
    renderer, lltok = PromptRenderer(loaded.card), tokenizer_for(loaded.card)
    engine = Engine(loaded)
    runner = asyncio.create_task(engine.run())
    await run_batch(engine, loaded, renderer, lltok, {}, 1, 4)  # warm-up
    print(f"model {spec.id} on {loaded.device}, {args.tokens} tokens per sequence, median of {args.repeat} runs")
    print(f"{'batch':>5}  {'case':<14} {'tokens/s':>9}  {'vs free text':>12}")
    for batch in args.batch:
        base = 0.0
        for name, case in CASES.items():
            rates = []
            for _ in range(args.repeat):
                tokens, seconds = await run_batch(engine, loaded, renderer, lltok, case, batch, args.tokens)
                rates.append(tokens / seconds)
            rate = statistics.median(rates)
            base = base or rate
            print(f"{batch:>5}  {name:<14} {rate:>9.1f}  {100 * (base - rate) / base:>+10.1f}% slower")
    runner.cancel()
    engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
