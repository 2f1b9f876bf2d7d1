"""Per-token cost of grammar-constrained decoding against unconstrained decoding, in process.

The same model, prompts, batch sizes and token budgets run through the worker's engine three times:
free text, a json_schema grammar and a forced tool call grammar. Only the constraint differs: every
case decodes from the same prompt tokens (a real request with tools also has a longer prompt, which
is the prompt's cost, not the grammar's), grammars are compiled before the clock starts, and every
sequence runs to its budget (the schemas demand long strings), so tokens/s compare like with like.
The cases alternate within each repeat, so that a drift in machine speed hits them alike.
``planned json`` is the json_schema case with plain strings, given its budget as a worker gives it:
the constraint then also keeps a closing plan in the last tokens (docs/protocol.md, "Output that fits
its budget") and its sequences end complete, at the budget or before.

    python -m bench.constrained [--model smollm2:135m-instruct] [--tokens 64] [--batch 1 8] [--repeat 3]
"""

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import msgspec

from lmsp_core import wire
from lmsp_core.requests import grammars
from lmsp_core.requests.catalog import Catalog
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.requests.closing import GrammarTokenizer
from lmsp_core.settings import load_settings
from workers.engine.core import Engine, Generation
from workers.engine.sampling import RowSampler, SamplingParams, Scores
from workers.model import loader
from workers.output.grammar import GrammarConstraint, tokenizer_for

# strings longer than any budget here: no sequence can end (close its JSON) before its budget
LONG_TEXT = {"type": "string", "minLength": 4096, "maxLength": 100000}
CASES: dict[str, dict[str, object]] = {
    "unconstrained": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": {
        "type": "object", "properties": {"title": LONG_TEXT, "body": LONG_TEXT}, "required": ["title", "body"]}}}},
    "tool call": {"tool_choice": "required", "tools": [{"type": "function", "name": "write", "parameters": {
        "type": "object", "properties": {"text": LONG_TEXT}, "required": ["text"]}}]},
    "planned json": {"response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": {
        "type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
        "required": ["title", "body"]}}}},
}
PLANNED = {"planned json"}  # given the budget: a closing plan is kept


class Done:
    def __init__(self) -> None:
        self.tokens = 0
        self.event = asyncio.Event()

    def on_token(self, seq: Generation, token: int, scores: Scores | None) -> None:
        self.tokens += 1

    def on_finish(self, seq: Generation, reason: str, error: BaseException | None) -> None:
        self.event.set()


async def run_batch(engine: Engine, loaded: loader.LoadedModel, renderer: PromptRenderer, lltok: GrammarTokenizer,
                    case: dict[str, object], batch: int, budget: int, planned: bool = False) -> tuple[int, float]:
    sequences, sinks = [], []
    for i in range(batch):
        fields = {"model": loaded.spec.id, "input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": f"Write a long article, number {i}."}]}]}
        plain = msgspec.convert(fields, wire.ResponseRequest)
        grammar = grammars.generation_grammar(msgspec.convert({**fields, **case}, wire.ResponseRequest))
        constraint = GrammarConstraint(lltok, grammar, budget=budget if planned else None) if grammar else None
        sink = Done()
        sinks.append(sink)
        # no stop tokens: every sequence runs to its budget
        sequences.append(Generation(renderer.prompt_ids(plain), budget, RowSampler(SamplingParams(), constraint), [],
                                  sink))
    start = time.perf_counter()
    for sequence in sequences:
        engine.submit(sequence)
    await asyncio.gather(*(sink.event.wait() for sink in sinks))
    return sum(sink.tokens for sink in sinks), time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    settings = load_settings()
    loader.limit_threads(settings.torch_threads, settings.attention_helper)  # as a worker would run
    spec = Catalog.from_settings(settings).get(args.model)
    loaded = loader.load(spec, Path(settings.model_cache))
    renderer, lltok = PromptRenderer(loaded.card), tokenizer_for(loaded.card)
    engine = Engine(loaded)
    runner = asyncio.create_task(engine.run())
    await run_batch(engine, loaded, renderer, lltok, {}, 1, 4)  # warm-up
    print(f"model {spec.id} on {loaded.device}, {args.tokens} tokens per sequence, median of {args.repeat} runs")
    print(f"{'batch':>5}  {'case':<14} {'tokens/s':>9}  {'vs free text':>12}")
    for batch in args.batch:
        rates: dict[str, list[float]] = {name: [] for name in CASES}
        for _ in range(args.repeat):
            for name, case in CASES.items():
                tokens, seconds = await run_batch(engine, loaded, renderer, lltok, case, batch, args.tokens,
                                                  name in PLANNED)
                assert tokens == batch * args.tokens or (name in PLANNED and tokens < batch * args.tokens), (
                    f"{name}: {tokens} tokens, not {batch} x {args.tokens}")
                rates[name].append(tokens / seconds)
        base = statistics.median(rates["unconstrained"])
        for name in CASES:
            rate = statistics.median(rates[name])
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
