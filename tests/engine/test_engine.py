"""The batching engine, in process: sequences that join and leave a running batch get exactly the
tokens they would get alone (greedy), each with its own budget."""

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.settings import load_settings
from tests.engine.support import Collector
from workers.engine.core import Engine, Finish, Generation
from workers.engine.sampling import RowSampler, SamplingParams, Scores
from workers.model import loader
from workers.model.cpu import kernels
from workers.model.plan import StepPlan


def alone(model: loader.LoadedModel, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


@pytest.mark.parametrize("launch_ahead", [False, True])
async def test_sequences_joining_and_leaving_match_solo_generation(tiny: loader.LoadedModel,
                                                                   launch_ahead: bool) -> None:
    engine = Engine(tiny, launch_ahead=launch_ahead)
    runner = asyncio.create_task(engine.run())
    prompts = [[1, 20, 30, 40], [1, 5] * 9, [7] * 3, list(range(100, 160)), [2, 3, 5, 7, 11]]
    budgets = [25, 7, 40, 12, 30]
    sinks = [Collector() for _ in prompts]
    try:
        for i, (prompt, budget, sink) in enumerate(zip(prompts, budgets, sinks, strict=True)):
            engine.submit(Generation(prompt, budget, RowSampler(SamplingParams()), [], sink))
            if i % 2:
                await asyncio.sleep(0.02)  # let some steps run so that the next ones join a running batch
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks)), 60)
    finally:
        runner.cancel()
        engine.close()
    for prompt, budget, sink in zip(prompts, budgets, sinks, strict=True):
        assert sink.reason is Finish.LENGTH
        assert sink.tokens == alone(tiny, prompt, budget)


async def test_long_sequences_with_the_attention_helper_match_solo_generation(tiny: loader.LoadedModel) -> None:
    """Decoding rows of ``kernels.HELPER_MIN_LENGTH`` positions or more share their attention with
    ``kernels.c``'s helper thread where torch's threads leave a core (this module runs torch on one):
    three sequences side by side, two past that length from their start and one crossing it while
    it decodes, give the tokens each gives alone."""
    assert max(kernels.HELPER_MIN_LENGTH, 300) < tiny.spec.context_window
    prompts = [list(range(3, 3 + kernels.HELPER_MIN_LENGTH - 10)), [5, 6] * 150, list(range(500, 200, -1))]
    engine = Engine(tiny)
    runner = asyncio.create_task(engine.run())
    sinks = [Collector() for _ in prompts]
    try:
        for prompt, sink in zip(prompts, sinks, strict=True):
            engine.submit(Generation(prompt, 24, RowSampler(SamplingParams()), [], sink))
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks)), 120)
    finally:
        runner.cancel()
        engine.close()
    for prompt, sink in zip(prompts, sinks, strict=True):
        assert sink.tokens == alone(tiny, prompt, 24)


@pytest.mark.parametrize("launch_ahead", [False, True])
async def test_stopping_one_sequence_leaves_the_others_intact(tiny: loader.LoadedModel, launch_ahead: bool) -> None:
    engine = Engine(tiny, launch_ahead=launch_ahead)
    runner = asyncio.create_task(engine.run())
    keep, stop = Collector(), Collector()
    stopped = Generation([1, 2, 3], 500, RowSampler(SamplingParams()), [], stop)
    try:
        engine.submit(Generation([4, 5, 6, 7], 30, RowSampler(SamplingParams()), [], keep))
        engine.submit(stopped)
        while len(stop.tokens) < 3:
            await asyncio.sleep(0.001)
        engine.stop(stopped, "cancelled")
        await asyncio.wait_for(asyncio.gather(keep.done.wait(), stop.done.wait()), 60)
    finally:
        runner.cancel()
        engine.close()
    assert stop.reason == "cancelled" and len(stop.tokens) < 10
    assert keep.tokens == alone(tiny, [4, 5, 6, 7], 30)


class FailingAfter(Collector):
    """A sink whose token handler raises at its ``n``-th token (as a bug in output handling would)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def on_token(self, seq: Generation, token: int, scores: Scores | None = None) -> None:
        super().on_token(seq, token, scores)
        if len(self.tokens) == self.n:
            raise KeyError("gone")


async def test_a_failing_token_handler_fails_its_sequence_and_the_engine_goes_on(tiny: loader.LoadedModel) -> None:
    engine = Engine(tiny)
    runner = asyncio.create_task(engine.run())
    failing, keep, later = FailingAfter(3), Collector(), Collector()
    try:
        engine.submit(Generation([1, 2, 3], 50, RowSampler(SamplingParams()), [], failing))
        engine.submit(Generation([4, 5, 6, 7], 30, RowSampler(SamplingParams()), [], keep))
        await asyncio.wait_for(asyncio.gather(failing.done.wait(), keep.done.wait()), 60)
        engine.submit(Generation([4, 5, 6, 7], 10, RowSampler(SamplingParams()), [], later))
        await asyncio.wait_for(later.done.wait(), 60)
    finally:
        runner.cancel()
        engine.close()
    assert failing.reason is Finish.ERROR and len(failing.tokens) == 3
    assert keep.tokens == alone(tiny, [4, 5, 6, 7], 30)
    assert later.reason is Finish.LENGTH and later.tokens == keep.tokens[:10]


async def test_stop_tokens_and_resumed_sequences(tiny: loader.LoadedModel) -> None:
    reference = alone(tiny, [9, 8, 7], 20)
    engine = Engine(tiny)
    runner = asyncio.create_task(engine.run())
    stops, resumed = Collector(), Collector()
    try:
        # stop at the 6th token; a sequence resumed after 8 tokens continues exactly
        engine.submit(Generation([9, 8, 7], 20, RowSampler(SamplingParams()), [reference[5]], stops))
        engine.submit(Generation([9, 8, 7], 20, RowSampler(SamplingParams()), [], resumed, generated=reference[:8]))
        await asyncio.wait_for(asyncio.gather(stops.done.wait(), resumed.done.wait()), 60)
    finally:
        runner.cancel()
        engine.close()
    assert stops.reason is Finish.STOP and stops.tokens == reference[:reference.index(reference[5]) + 1]
    assert resumed.reason is Finish.LENGTH and resumed.tokens == reference[8:]



@pytest.mark.parametrize("launch_ahead", [False, True])
async def test_grammar_constrained_and_free_sequences_share_a_batch(tiny: loader.LoadedModel,
                                                                   launch_ahead: bool) -> None:
    import json

    import msgspec

    from lmsp_core import wire
    from lmsp_core.requests import grammars
    from lmsp_core.requests.chat import PromptRenderer
    from workers.output.grammar import GrammarConstraint, tokenizer_for

    schema = {"type": "object", "properties": {"size": {"enum": ["small", "large"]}, "count": {"type": "integer"}},
              "required": ["size"], "additionalProperties": False}
    message = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
    request = msgspec.convert({"model": "tiny-random", "input": [message], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}, wire.ResponseRequest)
    grammar = grammars.generation_grammar(request)
    assert grammar is not None
    engine = Engine(tiny, launch_ahead=launch_ahead)
    runner = asyncio.create_task(engine.run())
    free, constrained = Collector(), Collector()
    try:
        engine.submit(Generation([4, 5, 6, 7], 30, RowSampler(SamplingParams()), [], free))
        await asyncio.sleep(0.02)  # the constrained one joins the running batch
        constraint = GrammarConstraint(tokenizer_for(tiny.card), grammar)
        engine.submit(Generation([1, 2, 3], 200, RowSampler(SamplingParams(), constraint),
                               tiny.card.stop_token_ids, constrained))
        await asyncio.wait_for(asyncio.gather(free.done.wait(), constrained.done.wait()), 60)
    finally:
        runner.cancel()
        engine.close()
    assert free.tokens == alone(tiny, [4, 5, 6, 7], 30)  # its neighbour's mask did not touch its row
    assert constrained.reason is Finish.STOP  # the grammar completed: random weights alone never would
    text = PromptRenderer(tiny.card).tokenizer.decode(constrained.tokens, skip_special_tokens=True)
    document = json.loads(text)
    assert document["size"] in ("small", "large") and set(document) <= {"size", "count"}


def tokens_of(seq: Generation) -> list[int]:
    assert isinstance(seq.sink, Collector)
    return seq.sink.tokens


async def run_engine(loaded: loader.LoadedModel, generations: list[tuple[list[int], int, str]]) -> list[Generation]:
    """On an engine of its own, each generation (prompt, budget, prefix scope) after the one before has
    finished; their tokens are their sinks' (``tokens_of``)."""
    engine = Engine(loaded)
    runner = asyncio.create_task(engine.run())
    done = []
    try:
        for prompt, budget, scope in generations:
            sink = Collector()
            done.append(seq := Generation(prompt, budget, RowSampler(SamplingParams()), [], sink, prefix_scope=scope))
            engine.submit(seq)
            await asyncio.wait_for(sink.done.wait(), 60)
        return done
    finally:
        runner.cancel()
        engine.close()


async def test_a_context_starts_after_the_prefix_a_slot_holds(tiny: loader.LoadedModel) -> None:
    prompt = list(range(100, 140))
    first, = await run_engine(tiny, [(prompt, 12, "")])
    answer = tokens_of(first)
    other = next(t for t in range(200, 300) if t != answer[5])
    next_turn = prompt + answer[:5] + [other, 9]
    elsewhere = list(range(500, 530))  # holds slot 0 meanwhile: the first prompt's prefix is moved aside
    seqs = await run_engine(tiny, [(prompt, 12, ""), (next_turn, 10, ""), (elsewhere, 5, ""), (prompt, 12, ""),
                                   (prompt, 12, "someone else")])
    assert [seq.cached_tokens for seq in seqs] == [0, len(prompt) + 5, 0, len(prompt) - 1, 0]
    for seq in seqs:  # the same greedy tokens as computed from nothing
        assert tokens_of(seq) == alone(tiny, seq.prompt_ids, seq.max_new_tokens)


async def test_a_prompt_sent_again_starts_in_its_own_slot_without_a_copy(tiny: loader.LoadedModel) -> None:
    """Its slot's prefix is not copied aside to keep the few tokens the new sequence overwrites (a
    copy of a long prompt's keys and values stalled every running stream); a sequence that would
    overwrite more of it still moves it aside."""
    prompt = list(range(100, 140))
    engine = Engine(tiny)
    copies: list[tuple[int, int, int]] = []
    copy_prefix = engine.model.copy_prefix

    def counted(source: int, target: int, length: int) -> None:
        copies.append((source, target, length))
        copy_prefix(source, target, length)

    engine.model.copy_prefix = counted  # type: ignore[method-assign]
    runner = asyncio.create_task(engine.run())
    seqs = []
    try:
        for context in (prompt, prompt, prompt[:20] + list(range(600, 630))):
            sink = Collector()
            seqs.append(seq := Generation(context, 12, RowSampler(SamplingParams()), [], sink))
            engine.submit(seq)
            await asyncio.wait_for(sink.done.wait(), 60)
            if len(seqs) == 2:
                assert copies == []
    finally:
        runner.cancel()
        engine.close()
    assert [seq.cached_tokens for seq in seqs] == [0, len(prompt) - 1, 20]
    # slot 0 held the prompt and the 11 tokens fed back (not the last): 31 of them would be lost
    assert [(source, length) for source, _, length in copies] == [(0, len(prompt) + 11)]
    for seq in seqs:
        assert tokens_of(seq) == alone(tiny, seq.prompt_ids, seq.max_new_tokens)


class HeldCopies:
    """An engine's copies between slots, each held back until ``release`` (and the threads they ran on)."""

    def __init__(self, engine: Engine) -> None:
        self.copy_prefix = engine.model.copy_prefix
        self.release = threading.Event()
        self.threads: list[str] = []
        engine.model.copy_prefix = self  # type: ignore[method-assign]

    def __call__(self, source: int, target: int, length: int) -> None:
        self.threads.append(threading.current_thread().name)
        if not self.release.wait(30):
            raise TimeoutError("the test did not release the copy")
        self.copy_prefix(source, target, length)

    async def started(self) -> None:
        while not self.threads:
            await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def copies_held_beside_a_running_sequence(
        loaded: loader.LoadedModel, kept: list[list[int]]) -> AsyncIterator[tuple[Engine, HeldCopies, Collector]]:
    """An engine whose slots 0 and 1 keep the prefixes of ``kept``'s two prompts, with a long
    generation running in slot 0 (that slot's prefix moved aside at once, nobody else running), three
    tokens in; its copies between slots held from then on (``HeldCopies``). Afterwards the copies are
    released and the engine is stopped and closed."""
    engine = Engine(loaded)
    runner = asyncio.create_task(engine.run())
    held: HeldCopies | None = None
    try:
        sinks = [Collector(), Collector()]
        for prompt, sink in zip(kept, sinks, strict=True):
            engine.submit(Generation(prompt, 8, RowSampler(SamplingParams()), [], sink))
        await asyncio.wait_for(asyncio.gather(*(sink.done.wait() for sink in sinks)), 60)
        running = Collector()
        engine.submit(Generation([7, 8, 9], 400, RowSampler(SamplingParams()), [], running))
        while len(running.tokens) < 3:
            await asyncio.sleep(0.001)
        held = HeldCopies(engine)
        yield engine, held, running
    finally:
        if held is not None:
            held.release.set()
        runner.cancel()
        engine.close()


async def test_copies_between_slots_run_beside_the_steps_of_running_sequences(tiny: loader.LoadedModel) -> None:
    """On a CPU, a sequence whose start moves a prefix aside waits for the copy while the running
    sequences go on stepping (a long prefix's copy into fresh memory stalled them all for up to 110
    ms); it then runs as it would have, and the prefix moved aside is reused later."""
    second, third = list(range(200, 230)), list(range(300, 330))
    async with copies_held_beside_a_running_sequence(tiny, [list(range(100, 130)), second]) as (engine, held, running):
        joining = Collector()  # slot 1: its prefix is moved aside beside the running sequence's steps
        engine.submit(Generation(third, 10, RowSampler(SamplingParams()), [], joining))
        await held.started()
        before = len(running.tokens)
        for _ in range(20_000):  # the running sequence steps while the copy waits
            if len(running.tokens) >= before + 5 or running.done.is_set():
                break
            await asyncio.sleep(0.001)
        stepped = len(running.tokens) - before
        held.release.set()
        await asyncio.wait_for(asyncio.gather(running.done.wait(), joining.done.wait()), 60)
        again = Collector()
        repeated = Generation(second, 6, RowSampler(SamplingParams()), [], again)
        engine.submit(repeated)
        await asyncio.wait_for(again.done.wait(), 60)
    assert stepped >= 5 and held.threads[0].startswith("copies-")
    assert joining.tokens == alone(tiny, third, 10)
    assert repeated.cached_tokens == len(second) - 1  # from the slot its prefix was moved to
    assert again.tokens == alone(tiny, second, 6)


async def test_a_sequence_cancelled_while_its_copies_run_takes_no_step(tiny: loader.LoadedModel) -> None:
    third, fourth = list(range(300, 330)), list(range(400, 430))
    prompted: list[int] = []  # the prompt tokens of every step's chunks
    kept = [list(range(100, 130)), list(range(200, 230))]
    async with copies_held_beside_a_running_sequence(tiny, kept) as (engine, held, running):
        run = engine.model.run

        def recorded(plan: StepPlan, fed: torch.Tensor | None = None) -> torch.Tensor:
            prompted.extend(token for chunk in plan.chunks for token in chunk.tokens)
            return run(plan) if fed is None else run(plan, fed)

        engine.model.run = recorded  # type: ignore[method-assign]
        cancelled = Collector()
        late = Generation(third, 10, RowSampler(SamplingParams()), [], cancelled)
        engine.submit(late)
        await held.started()
        engine.stop(late, Finish.CANCELLED)
        held.release.set()
        await asyncio.wait_for(running.done.wait(), 60)
        after = Collector()
        engine.submit(Generation(fourth, 4, RowSampler(SamplingParams()), [], after))
        await asyncio.wait_for(after.done.wait(), 60)
    assert cancelled.reason is Finish.CANCELLED and cancelled.tokens == []
    assert not set(third) & set(prompted) and set(fourth) <= set(prompted)  # no step took its prompt
    assert after.tokens == alone(tiny, fourth, 4)


async def test_a_joining_context_copies_the_prefix_of_a_running_one(tiny: loader.LoadedModel) -> None:
    shared = list(range(300, 340))
    engine = Engine(tiny)
    runner = asyncio.create_task(engine.run())
    running, joining = Collector(), Collector()
    long = Generation([*shared, 1], 60, RowSampler(SamplingParams()), [], running)
    try:
        engine.submit(long)
        while len(running.tokens) < 3:
            await asyncio.sleep(0.001)
        late = Generation([*shared, 2, 3], 20, RowSampler(SamplingParams()), [], joining)
        engine.submit(late)
        await asyncio.wait_for(asyncio.gather(running.done.wait(), joining.done.wait()), 60)
    finally:
        runner.cancel()
        engine.close()
    assert late.cached_tokens == len(shared)  # copied from the running sequence's slot into its own
    assert joining.tokens == alone(tiny, [*shared, 2, 3], 20)
    assert running.tokens == alone(tiny, [*shared, 1], 60)  # the copy left its source as it was


async def test_prefix_reuse_is_a_model_setting(tiny: loader.LoadedModel) -> None:
    import dataclasses

    import msgspec

    off = dataclasses.replace(tiny, spec=msgspec.structs.replace(tiny.spec, reuse_prefixes=False))
    seqs = await run_engine(off, [([5, 6, 7, 8], 6, ""), ([5, 6, 7, 8], 6, "")])
    assert [seq.cached_tokens for seq in seqs] == [0, 0]
    assert tokens_of(seqs[0]) == tokens_of(seqs[1])


def test_llama_8b_random_has_the_8b_shape() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmsp_core.requests.catalog import LLAMA_8B_RANDOM, SMOLLM2

    tokenizer = AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, Path(load_settings().model_cache)))
    config = loader.random_llama_config(LLAMA_8B_RANDOM, tokenizer)
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(config)
    # Llama-3.1-8B's 8.03e9 parameters, less the embedding rows of the larger vocabulary
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248 - 2 * (128_256 - 49_152) * 4096
    assert LLAMA_8B_RANDOM.dtype == "bfloat16"


async def test_random_llama_models_load_on_the_device_in_their_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(loader.LLAMA_SHAPES, "small", {"hidden_size": 64, "intermediate_size": 128,
                                                       "num_hidden_layers": 2, "num_attention_heads": 4,
                                                       "num_key_value_heads": 2})
    spec = ModelSpec(id="small-random", source="random-llama:small", context_window=256, max_output_tokens=16,
                     capabilities=["streaming"], dtype="bfloat16", compile=False)
    loaded = loader.load(spec, Path(load_settings().model_cache))
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    engine = Engine(loaded)
    runner = asyncio.create_task(engine.run())
    try:
        collector = Collector()
        engine.submit(Generation([1, 2, 3], 5, RowSampler(SamplingParams()), [], collector))
        await asyncio.wait_for(collector.done.wait(), 30)
        assert collector.reason is Finish.LENGTH and len(collector.tokens) == 5
    finally:
        runner.cancel()
        engine.close()
    bad = ModelSpec(id="bad", source="random-llama:nope", context_window=256, max_output_tokens=16,
                    capabilities=["streaming"])
    with pytest.raises(ValueError, match="unknown shape"):
        loader.load(bad, Path(load_settings().model_cache))


class FedSteps:
    """Wraps an engine's model: the rows of every step that was fed its tokens on the device."""

    def __init__(self, engine: Engine) -> None:
        self.run = engine.model.run
        self.rows: list[int] = []
        engine.model.run = self  # type: ignore[method-assign]

    def __call__(self, plan: StepPlan, fed: torch.Tensor | None = None) -> torch.Tensor:
        if fed is None:
            return self.run(plan)
        self.rows.append(len(plan.feeds))
        return self.run(plan, fed)


async def generate_side_by_side(engine: Engine, generations: list[Generation]) -> None:
    """Run ``generations`` (their sinks ``Collector``s) on ``engine``, all submitted before its first
    step (the same batches every time), until each has finished."""
    for seq in generations:
        engine.submit(seq)
    runner = asyncio.create_task(engine.run())
    sinks = [seq.sink for seq in generations if isinstance(seq.sink, Collector)]
    assert len(sinks) == len(generations)
    try:
        await asyncio.wait_for(asyncio.gather(*(sink.done.wait() for sink in sinks)), 60)
    finally:
        runner.cancel()
        engine.close()


async def test_steps_launched_ahead_give_the_tokens_of_steps_run_one_at_a_time(tiny: loader.LoadedModel) -> None:
    """On a GPU a decoding step starts before the last one's tokens are read, fed them on the device
    (``launch_ahead``); forced on here. Greedy and seeded sampled sequences, with budgets that end
    them at different steps and one ending on a stop token (its row of the step launched meanwhile
    wasted), get the tokens and finish reasons of steps run one at a time."""
    reference = alone(tiny, [9, 8, 7], 30)
    stop_at = reference[11]
    prompts = [[9, 8, 7], [1, 20, 30, 40], [7] * 3, list(range(100, 140)), [2, 3, 5, 7, 11]]
    samplers = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=3),
                SamplingParams(temperature=1.2, seed=11), SamplingParams(temperature=0.7, top_p=0.5, seed=5)]
    budgets = [30, 9, 40, 17, 25]
    outcomes, fed = [], []
    for launch_ahead in (False, True):
        engine = Engine(tiny, launch_ahead=launch_ahead)
        steps = FedSteps(engine)
        generations = [Generation(prompt, budget, RowSampler(params), [stop_at] if i == 0 else [], Collector())
                       for i, (prompt, budget, params) in enumerate(zip(prompts, budgets, samplers, strict=True))]
        await generate_side_by_side(engine, generations)
        outcomes.append([(tokens_of(seq), seq.finish_reason) for seq in generations])
        fed.append(steps.rows)
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][0] == (reference[:reference.index(stop_at) + 1], Finish.STOP)
    assert outcomes[0][1] == (alone(tiny, prompts[1], 9), Finish.LENGTH)
    assert all(reason is Finish.LENGTH for _, reason in outcomes[0][1:])
    assert fed[0] == []
    # ahead: most steps, of every row count; not the first, nor those after a sequence ended
    assert {5, 4, 3, 2, 1} <= set(fed[1]) and len(fed[1]) >= 30


def reference_logprobs(model: loader.LoadedModel, context: list[int]) -> torch.Tensor:
    """transformers' own log-softmax of the next token's logits after ``context``, float32."""
    with torch.inference_mode():
        logits = model.model(torch.tensor([context])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("launch_ahead", [False, True])
async def test_log_probabilities_are_the_models_log_softmax(tiny: loader.LoadedModel, launch_ahead: bool) -> None:
    """Beside a row that asks for none, a greedy row and a sampled one (top-p: the reported values
    are the model's, before the sampling settings) report each chosen token's log-probability and
    the five most likely tokens', as transformers computes them from the same context."""
    prompts = [[1, 20, 30, 40], [2, 3, 5, 7, 11], [9, 8, 7]]
    params = [SamplingParams(logprobs=5), SamplingParams(temperature=1.3, top_p=0.9, seed=3, logprobs=5),
              SamplingParams()]
    engine = Engine(tiny, launch_ahead=launch_ahead)
    runner = asyncio.create_task(engine.run())
    sinks = [Collector() for _ in prompts]
    try:
        for prompt, param, sink in zip(prompts, params, sinks, strict=True):
            engine.submit(Generation(prompt, 6, RowSampler(param), [], sink))
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks)), 60)
    finally:
        runner.cancel()
        engine.close()
    assert sinks[2].scores == [None] * 6
    for prompt, sink in zip(prompts[:2], sinks[:2], strict=True):
        assert len(sink.scores) == len(sink.tokens) == 6
        for index, (token, scores) in enumerate(zip(sink.tokens, sink.scores, strict=True)):
            expected = reference_logprobs(tiny, prompt + sink.tokens[:index])
            assert isinstance(scores, Scores) and len(scores.top) == 5
            assert scores.logprob == pytest.approx(float(expected[token]), abs=1e-3)
            values, ids = expected.topk(6)  # the sixth: where the fifth ties with it, either may be reported
            assert [value for _, value in scores.top] == pytest.approx(values[:5].tolist(), abs=1e-3)
            assert {other for other, _ in scores.top} == set(ids[:5].tolist()) or values[4] - values[5] < 2e-3
