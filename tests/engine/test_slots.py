"""The slot decoder and the engine's scheduling, in process: the same tokens as transformers for
every architecture it runs, prompts joining in chunks, a cache that is never reallocated, 4-bit
weights only where they lose nothing, and a compiled step that decodes as the eager one."""

import asyncio
import contextlib
import copy
import fcntl
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from lmsp_core.requests.catalog import SMOLLM2, TINY_RANDOM
from lmsp_core.settings import load_settings
from tests.engine.support import Collector, built_for, one_calls, shared_kernel_dir
from workers.engine import chunkprice, scheduler
from workers.engine.core import Engine, Finish, Generation
from workers.engine.sampling import RowSampler, SamplingParams
from workers.model import linear, loader, precision
from workers.model.build import cache_dtype
from workers.model.cpu import kernels
from workers.model.cpu.groups import Groups4, Groups8
from workers.model.decoder import Decoder, unsupported_reason
from workers.model.fallback import HfSlots
from workers.model.linear import int4_product
from workers.model.lmhead import REFINED
from workers.model.plan import Chunk, Feed, StepPlan

SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "initializer_range": 0.5}  # peaked logits: greedy choices far from ties
CONFIGS: dict[str, Any] = {
    "llama": LlamaConfig(**SMALL),
    "llama, biases": LlamaConfig(**SMALL, attention_bias=True),
    "qwen2": Qwen2Config(**SMALL),
    "qwen3": Qwen3Config(**SMALL, head_dim=32),
    "mistral": MistralConfig(**SMALL, sliding_window=None),
}


def random_model(config: Any, dtype: torch.dtype = torch.float32) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def generate(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def decode_greedy(model: Decoder | HfSlots, prompt: list[int], n: int, slot: int = 1, chunk: int = 1000) -> list[int]:
    """Greedy tokens through ``run``: the prompt in chunks of ``chunk``, then one token per step."""
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            piece = prompt[start:start + chunk]
            logits = model.run(StepPlan(chunks=[Chunk(slot, start, piece, start + len(piece) == len(prompt))]))
        tokens = [int(logits[0].argmax())]
        while len(tokens) < n:
            logits = model.run(StepPlan(feeds=[Feed(slot, tokens[-1], len(prompt) + len(tokens) - 1)]))
            tokens.append(int(logits[0].argmax()))
    return tokens


def forced_logits(model: Decoder, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits of each decoding step when ``tokens`` are fed one at a time after the prompt."""
    with torch.inference_mode():
        model.run(StepPlan(chunks=[Chunk(1, 0, prompt, True)]))
        steps = [model.run(StepPlan(feeds=[Feed(1, token, len(prompt) + i)]))[0]
                 for i, token in enumerate(tokens)]
    return torch.stack(steps)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernels.c"])
@pytest.mark.parametrize("kind", CONFIGS)
def test_the_slot_decoder_matches_transformers(kind: str, kernel: bool) -> None:
    model = random_model(CONFIGS[kind])
    prompt = list(range(7, 40))
    reference = generate(model, prompt, 20)
    assert unsupported_reason(model) is None
    decoder = Decoder(model, slots=3, positions=256)
    if kernel:  # attention, norms, rotation and the MLP's activation through workers/model/cpu/kernels.c
        decoder.use_kernels(kernels.load(shared_kernel_dir()))
        assert decoder.attention is not None
        assert all(layer.native_norm is not None for layer in decoder.typed_layers)
        assert (decoder._rope_store is not None) == (kind != "qwen3")  # qwen3 norms queries and keys first
        alone = decoder._kernel_rows(StepPlan(chunks=[Chunk(0, 0, prompt, True)]), 0)
        assert alone is not None and len(alone[0]) == len(prompt)  # a 33-token prompt alone: all through kernels.c
        # slot 2 decoding at position 40, rows 0 and 1 dummies: they attend to nothing (their output is dropped)
        holes = decoder._kernel_rows(StepPlan(feeds=[Feed(2, 5, 40)]), 3)
        assert holes is not None and holes[1].tolist() == [-1, -1, 40]
        for layer in decoder.typed_layers:  # float32 products: the MLP's activation through kernels.c
            native = layer.native_activation
            assert native is not None
            layer.native_activation = lambda x, native=native: activated.append(x.shape[0]) or native(x)
    activated: list[int] = []
    with one_thread() if kernel else contextlib.nullcontext():  # where the kernel runs, whatever the cores
        with torch.inference_mode():
            logits = decoder.run(StepPlan(chunks=[Chunk(0, 0, prompt, True)]))[0]
            expected = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert decode_greedy(decoder, prompt, 20) == reference
        assert decode_greedy(decoder, prompt, 20, slot=2, chunk=5) == reference  # the prompt in chunks
    assert bool(activated) == kernel
    assert generate(model, prompt, 20) == reference  # the model works on with the fused weights' views


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernels.c"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # the cache written by kernels.c's rotation, and by torch's
def test_a_float16_cache_decodes_within_its_rounding(kind: str, kernel: bool) -> None:
    model = random_model(CONFIGS[kind])
    prompt = list(range(7, 40))
    exact = Decoder(model, slots=3, positions=256)
    tokens = decode_greedy(exact, prompt, 20)
    expected = forced_logits(exact, prompt, tokens)
    built = kernels.load(shared_kernel_dir()) if kernel else None

    def error(cache_dtype: torch.dtype) -> float:
        decoder = Decoder(model, slots=3, positions=256, cache_dtype=cache_dtype)
        decoder.use_kernels(built)
        assert decoder.cache.layer(1)[1].dtype == cache_dtype
        with one_thread() if kernel else contextlib.nullcontext():
            assert cache_dtype != torch.float16 or decode_greedy(decoder, prompt, 20, slot=2, chunk=5) == tokens
            return float((forced_logits(decoder, prompt, tokens) - expected).norm() / expected.norm())

    # float16 keeps 3 more bits than bfloat16: its logits are off the float32 cache's by far less
    half, brain = error(torch.float16), error(torch.bfloat16)
    assert 0 < half < brain / 4, (half, brain)


def test_other_architectures_run_through_transformers() -> None:
    model = random_model(GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                    initializer_range=0.5))
    assert "gpt2" in (unsupported_reason(model) or "")
    prompt = list(range(3, 20))
    fallback = HfSlots(model, slots=2, device=torch.device("cpu"))
    assert decode_greedy(fallback, prompt, 12, chunk=6) == generate(model, prompt, 12)


def recording(engine: Engine) -> list[StepPlan]:
    """Every plan the engine's model runs, from now on."""
    plans: list[StepPlan] = []
    run: Callable[..., torch.Tensor] = engine.model.run

    def recorded(plan: StepPlan, fed: torch.Tensor | None = None) -> torch.Tensor:
        plans.append(plan)
        return run(plan) if fed is None else run(plan, fed)

    engine.model.run = recorded  # type: ignore[method-assign]
    return plans


async def run_engine(engine: Engine, jobs: list[tuple[list[int], int, float]]) -> list[Collector]:
    """Submit (prompt, budget, delay before submitting) in order; wait for all to finish."""
    runner = asyncio.create_task(engine.run())
    sinks = [Collector() for _ in jobs]
    try:
        await engine.ready()
        for (prompt, budget, delay), sink in zip(jobs, sinks, strict=True):
            await asyncio.sleep(delay)
            engine.submit(Generation(prompt, budget, RowSampler(SamplingParams()), [], sink))
        await asyncio.wait_for(asyncio.gather(*(sink.done.wait() for sink in sinks)), 120)
    finally:
        runner.cancel()
        engine.close()
    return sinks


async def test_a_long_prompt_joins_in_chunks_between_decoding_steps(tiny: loader.LoadedModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "MAX_CHUNK", 16)
    engine = Engine(tiny)
    assert isinstance(engine.model, Decoder)
    assert engine.model.attention is not None  # chunks beside decoding attend through kernels.c, with them
    keys, values = engine.model.cache.layer(0)
    addresses = (keys.data_ptr(), values.data_ptr())
    plans = recording(engine)
    long_prompt = list(range(200, 300))
    jobs = [([1, 20, 30, 40], 200, 0.0), ([5, 6, 7], 40, 0.0), (long_prompt, 10, 0.05), ([9, 9, 9], 5, 0.0)]
    sinks = await run_engine(engine, jobs)
    for (prompt, budget, _), sink in zip(jobs, sinks, strict=True):
        assert sink.reason is Finish.LENGTH
        assert sink.tokens == generate(tiny.model, prompt, budget)
    # the long prompt went in over several steps, beside the others' decoding
    chunks = [chunk for plan in plans for chunk in plan.chunks if chunk.tokens[0] >= 200 or chunk.start > 0]
    assert len(chunks) >= len(long_prompt) // 16 and all(len(chunk.tokens) <= 16 for chunk in chunks)
    assert any(plan.feeds and plan.chunks for plan in plans)
    # slots were taken lowest first and reused; the cache was never reallocated
    assert max(feed.slot for plan in plans for feed in plan.feeds) <= 3
    assert (keys.data_ptr(), values.data_ptr()) == addresses
    assert engine.model.cache.layer(0)[0] is keys


def fitted(engine: Engine, chunks: list[tuple[int, float]], last_chunked: int) -> scheduler.Scheduler:
    """The engine's scheduler as if it had run 100 ms decoding steps and steps with ``chunks`` (prompt
    tokens at position 40, seconds they added), the last with ``last_chunked`` tokens."""
    chosen = engine._scheduler
    chosen._decode_seconds = 0.1
    for tokens, seconds in chunks:
        chosen._chunk_cost.add(tokens, tokens * 40, seconds)
    chosen._last_chunked = last_chunked
    return chosen


def test_a_chunk_beside_decoding_grows_at_most_by_half(tiny: loader.LoadedModel) -> None:
    engine = Engine(tiny)
    try:
        # measured as free: the fit alone would take MAX_CHUNK
        chosen = fitted(engine, [(10, 1e-6), (10, 1e-6), (10, 1e-6)], last_chunked=10)
        assert chosen._chunk_budget(decoding=2, joining=1, start=40) == 15
        assert chosen._chunk_budget(decoding=0, joining=1, start=40) == scheduler.PREFILL_TOKENS  # nobody to stall
    finally:
        engine.close()


def test_a_chunk_beside_decoding_stays_within_the_rows_a_step_runs_cheapest(tiny: loader.LoadedModel,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of more rows than the model's ``one_call_rows`` costs a jump the linear price does not
    see (its layers leave the one call): a chunk beside decoding stays within them, measured or not."""
    engine = Engine(tiny)
    try:
        monkeypatch.setattr(Decoder, "one_call_rows", property(lambda self: 16))
        chosen = fitted(engine, [(10, 1e-6), (10, 1e-6), (10, 1e-6)], last_chunked=10)
        assert chosen._chunk_budget(decoding=2, joining=1, start=40) == 14
        assert chosen._chunk_budget(decoding=8, joining=1, start=40) == 8
        assert chosen._chunk_budget(decoding=8, joining=1, start=40, rows=11) == 5  # dummy rows count too
        assert chosen._chunk_budget(decoding=15, joining=1, start=40) == chunkprice.MIN_CHUNK  # never fewer
        assert chosen._chunk_budget(decoding=16, joining=1, start=40) == 15  # already past it: the price alone decides
        assert chosen._chunk_budget(decoding=0, joining=1, start=40) == scheduler.PREFILL_TOKENS
        chosen._chunk_cost = chunkprice.ChunkCost()  # before the price is known
        assert chosen._chunk_budget(decoding=8, joining=1, start=40) == 8 < scheduler.FIRST_CHUNK
    finally:
        engine.close()


def test_a_decoding_step_is_priced_at_the_median_of_recent_ones(tiny: loader.LoadedModel) -> None:
    """A few slow decoding steps (streams starting, a busy moment) do not raise the price of every
    chunk after them, as a running mean did (it read 32 ms where the steps took 25)."""
    engine = Engine(tiny)
    try:
        chosen = engine._scheduler
        decoding = StepPlan(feeds=[Feed(0, 1, 40), Feed(1, 1, 40)])
        for seconds in [0.3, 0.25, 0.2] + [0.1] * 6:
            chosen._measure(decoding, seconds)
        assert chosen._decode_seconds == 0.1
        for _ in range(scheduler.DECODE_STEPS):
            chosen._measure(decoding, 0.04)
        assert chosen._decode_seconds == 0.04  # only the recent ones
        # a step with chunks beside decoding is priced against it: what it took beyond 40 ms
        chosen._measure(StepPlan(feeds=decoding.feeds, chunks=[Chunk(2, 0, [1] * 10, False)]), 0.05)
        assert chosen._decode_seconds == 0.04
        price = chosen._chunk_cost.fit()
        assert price is not None and price.per_token == pytest.approx(0.001)  # 10 ms for 10 tokens
    finally:
        engine.close()


def test_prompts_waiting_beside_fewer_decoding_streams_take_more_per_step(tiny: loader.LoadedModel) -> None:
    engine = Engine(tiny)
    try:
        # 1 ms a prompt token; growth not what limits it here
        chosen = fitted(engine, [(tokens, 0.001 * tokens) for tokens in (10, 20, 30)], last_chunked=400)
        one_joining = chosen._chunk_budget(decoding=2, joining=1, start=40)
        assert chunkprice.STALL * 100 - 5 <= one_joining <= chunkprice.STALL * 100  # STALL of a 100 ms step
        # four prompts wait beside one decoding stream: their wait weighs four times its stall
        assert abs(chosen._chunk_budget(decoding=1, joining=4, start=40) - 4 * one_joining) <= 4
    finally:
        engine.close()


async def test_prompts_that_arrive_together_while_nobody_decodes_go_in_at_once(tiny: loader.LoadedModel) -> None:
    engine = Engine(tiny)
    plans = recording(engine)
    prompts = [list(range(100 + i, 400 + i)) for i in range(3)]  # 900 tokens: more than one sequence's chunk
    sinks = [Collector() for _ in prompts]
    for prompt, sink in zip(prompts, sinks, strict=True):  # all waiting before the first step
        engine.submit(Generation(prompt, 4, RowSampler(SamplingParams()), [], sink))
    runner = asyncio.create_task(engine.run())
    try:
        await asyncio.wait_for(asyncio.gather(*(sink.done.wait() for sink in sinks)), 60)
    finally:
        runner.cancel()
        engine.close()
    first = next(plan for plan in plans if plan.chunks and not plan.feeds and plan.chunks[0].tokens[0] >= 100)
    assert [(chunk.slot, len(chunk.tokens), chunk.last) for chunk in first.chunks] == [(0, 300, True), (1, 300, True),
                                                                                       (2, 300, True)]
    for prompt, sink in zip(prompts, sinks, strict=True):
        assert sink.tokens == generate(tiny.model, prompt, 4)


async def test_auto_keeps_a_float32_models_cache_in_float16_where_kernels_c_attends(
        tiny: loader.LoadedModel, caplog: pytest.LogCaptureFixture) -> None:
    assert tiny.kernel_dir is not None
    built = kernels.load(tiny.kernel_dir)
    assert built is not None
    auto = loader.LoadedModel(msgspec.structs.replace(TINY_RANDOM, kv_dtype="auto"), tiny.model, tiny.card,
                              tiny.device, kernel_dir=tiny.kernel_dir)
    in_bfloat16 = loader.LoadedModel(auto.spec, random_model(CONFIGS["llama"], torch.bfloat16), tiny.card, tiny.device)
    half = torch.float16 if built.f16_fast else torch.float32  # F16C converts it (every x86-64 CPU with AVX2)
    with one_thread():
        assert cache_dtype(auto, built, compile=False) == half
        assert cache_dtype(auto, built, compile=True) == torch.float32  # a compiled step attends through torch
        assert cache_dtype(auto, None, compile=False) == torch.float32
        assert cache_dtype(in_bfloat16, built, compile=False) == torch.bfloat16
        assert cache_dtype(tiny, built, compile=False) == torch.float32  # tiny-random asks for float32
        with caplog.at_level(logging.INFO, logger="workers.model.build"):
            engine = Engine(auto)
    assert isinstance(engine.model, Decoder) and engine.model.cache.layer(0)[0].dtype == half
    assert f"float32 weights, keys and values in {str(half).removeprefix('torch.')}" in caplog.text
    sink = Collector()
    engine.submit(Generation(list(range(5, 300)), 40, RowSampler(SamplingParams()), [], sink))
    runner = asyncio.create_task(engine.run())
    try:
        await asyncio.wait_for(sink.done.wait(), 60)
    finally:
        runner.cancel()
        engine.close()
    assert sink.reason == "length" and len(sink.tokens) == 40


async def test_a_free_slot_is_taken_by_the_next_sequence(tiny: loader.LoadedModel) -> None:
    engine = Engine(tiny)
    plans = recording(engine)
    sinks = await run_engine(engine, [([1, 2, 3], 4, 0.0), ([4, 5, 6], 300, 0.0), ([7, 8], 5, 0.3)])
    assert all(sink.reason is Finish.LENGTH for sink in sinks)
    first_chunk = {tuple(chunk.tokens): chunk.slot for plan in plans for chunk in plan.chunks}
    assert first_chunk[(1, 2, 3)] == 0 and first_chunk[(4, 5, 6)] == 1
    assert first_chunk[(7, 8)] == 0  # the first sequence had finished: its slot was free again


def q4_layers_model() -> tuple[Any, dict[str, torch.Tensor]]:
    """A random llama whose layer weights are on Q4_1's grid, and its float32 weights by name."""
    model = random_model(CONFIGS["llama"])
    down = model.model.layers[0].mlp.down_proj.weight.detach()
    assert not Groups4.of(down).exact(down)
    with torch.no_grad():  # every layer weight as a Q4_1 GGUF holds it: code * scale + min, fp16 scale and min
        for name, weight in model.named_parameters():
            if name.startswith("model.layers") and weight.dim() == 2:
                groups = weight.view(weight.shape[0], -1, 32)
                low = groups.amin(-1, keepdim=True).half().float()
                scale = ((groups.amax(-1, keepdim=True) - low) / 15).half().float()
                groups.copy_(((groups - low) / scale).round().clamp(0, 15) * scale + low)
    return model, {name: weight.detach().clone() for name, weight in model.named_parameters() if weight.dim() == 2}


def test_4_bit_weights_only_where_they_lose_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model, exact = q4_layers_model()
    query = exact["model.layers.1.self_attn.q_proj.weight"]
    assert Groups4.of(query).exact(query)
    in_bfloat16 = copy.deepcopy(model).to(torch.bfloat16)
    prompt = list(range(10, 30))
    dense = Decoder(model, slots=2, positions=256)  # float32: the weights exactly
    tokens = decode_greedy(dense, prompt, 16)
    packed = Decoder(model, slots=2, positions=256)
    assert packed.pack_int4(exact, rows=4, lossless_only=True)
    assert packed.typed_layers[0].qkv.int4 is not None
    # the same tokens fed to each: the 4-bit decoding steps are off the exact logits by the bfloat16
    # rounding of the products' inputs and scales, no more than the dense model in bfloat16 is
    expected = forced_logits(dense, prompt, tokens)

    def error(model: Decoder) -> float:
        return float((forced_logits(model, prompt, tokens) - expected).norm() / expected.norm())

    rounding = error(Decoder(in_bfloat16, slots=2, positions=256))
    assert error(packed) <= rounding < 0.1
    # weights off the grid (the same model before its rounding to 4 bits) are much further off
    assert error(Decoder(random_model(CONFIGS["llama"]), slots=2, positions=256)) > 3 * rounding
    # a step whose rows are too many for the 4-bit products (two decoding rows and a prompt chunk,
    # 4-bit up to two rows) still decodes its two rows on them, as a decoding-only step would
    mixed = Decoder(model, slots=3, positions=256)
    assert mixed.pack_int4(exact, rows=2, lossless_only=True)
    with torch.inference_mode():
        for slot in (0, 1):
            mixed.run(StepPlan(chunks=[Chunk(slot, 0, prompt, True)]))
        feeds = [Feed(slot, tokens[slot], len(prompt)) for slot in (0, 1)]
        alone = mixed.run(StepPlan(feeds=feeds))
        beside_chunk = mixed.run(StepPlan(feeds=feeds, chunks=[Chunk(2, 0, prompt, True)]))
    # equal but for the dense output layer's float32 sums, whose order MKL picks by the row count
    # (2 rows alone, 3 beside the chunk) on some CPUs; the dense products would be ~1e-3 off
    torch.testing.assert_close(beside_chunk[:2], alone, rtol=1e-6, atol=1e-5)
    # where a dense chunk product takes the decoding rows along (``merge_rows``), they run on the
    # dense weights with the chunk: no 4-bit pass of the layers, the dense model's logits
    merging, plain = Decoder(model, slots=3, positions=256), Decoder(model, slots=3, positions=256)
    assert merging.pack_int4(exact, rows=2, lossless_only=True, merge_rows=2)
    passes: list[int] = []
    int4_pass = linear.int4_product
    monkeypatch.setattr(linear, "int4_product", lambda *args: passes.append(1) or int4_pass(*args))
    with torch.inference_mode():
        for decoder in (merging, plain):
            for slot in (0, 1):
                decoder.run(StepPlan(chunks=[Chunk(slot, 0, prompt, True)]))
        merged = merging.run(StepPlan(feeds=feeds, chunks=[Chunk(2, 0, prompt, True)]))
        assert not passes
        torch.testing.assert_close(merged, plain.run(StepPlan(feeds=feeds, chunks=[Chunk(2, 0, prompt, True)])),
                                   rtol=1e-6, atol=1e-5)
        merging.run(StepPlan(feeds=feeds))  # decoding alone still runs on the 4-bit weights
    assert passes
    # decoding rows too many for the 4-bit weights go in one dense product with the chunk's
    crowded = Decoder(model, slots=4, positions=256)
    assert crowded.pack_int4(exact, rows=2, lossless_only=True)
    products: list[int] = []
    dense_product = linear.Linear._dense
    monkeypatch.setattr(linear.Linear, "_dense", lambda self, x: products.append(x.shape[0]) or dense_product(self, x))
    with torch.inference_mode():
        for slot in (0, 1, 2):
            crowded.run(StepPlan(chunks=[Chunk(slot, 0, prompt, True)]))
        products.clear()
        crowded.run(StepPlan(feeds=[Feed(slot, tokens[0], len(prompt)) for slot in (0, 1, 2)],
                             chunks=[Chunk(3, 0, prompt, True)]))
    # the layers' products: the 3 decoding rows with the chunk; and the output layer's 4 rows of logits
    assert set(products) == {3 + len(prompt), 4}, products
    # weights off the grid: auto leaves them dense
    unpacked = Decoder(random_model(CONFIGS["llama"], torch.bfloat16), slots=2, positions=256)
    other = {name: w.detach().float() for name, w in random_model(CONFIGS["llama"]).named_parameters()}
    assert not unpacked.pack_int4(other, rows=4, lossless_only=True)
    assert unpacked.typed_layers[0].qkv.int4 is None


def q8_output_model() -> tuple[Any, dict[str, torch.Tensor]]:
    """A random llama whose output layer is on Q8_0's grid, and its float32 weights by name."""
    model = random_model(CONFIGS["llama"])
    with torch.no_grad():
        groups = model.lm_head.weight.view(model.lm_head.weight.shape[0], -1, 32)
        scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
        groups.copy_((groups / scale).round().clamp(-127, 127) * scale)
    return model, {name: weight.detach().clone() for name, weight in model.named_parameters() if weight.dim() == 2}


def test_an_output_layer_in_8_bits_runs_on_8_bit_groups() -> None:
    """GGUF models keep the output layer in Q8_0 (a code -127..127 per weight, a float16 scale per
    32): the decoding steps run it on those codes, as close to the exact logits as the 4-bit layers
    are; an output layer on no such grid stays dense unless the spec asks for lossy packing."""
    model, exact = q8_output_model()
    groups = exact["lm_head.weight"].view(exact["lm_head.weight"].shape[0], -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
    q8 = (groups / scale).round().clamp(-127, 127)
    head = exact["lm_head.weight"]
    assert Groups8.of(head).exact(head) and not Groups4.of(head).exact(head)
    codes, scales_zeros = Groups8.of(head).for_torch()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    product = int4_product(x, codes, scales_zeros.to(torch.bfloat16), inputs_twice=True).float()
    # every weight back as its code times its scale rounded to bfloat16; the inputs and the sum in bfloat16
    scale_bf16 = scale.to(torch.bfloat16).float()
    weights_bf16 = (q8 * scale_bf16).view(-1, 64)
    torch.testing.assert_close(product, x.to(torch.bfloat16).float() @ weights_bf16.T, rtol=2 ** -8, atol=1e-3)

    prompt, dense = list(range(10, 30)), Decoder(model, slots=2, positions=256)
    tokens = decode_greedy(dense, prompt, 16)
    expected = forced_logits(dense, prompt, tokens)
    packed = Decoder(model, slots=2, positions=256)
    packed.pack_int4(exact, rows=4, lossless_only=True)  # the layers are off their grid: only the output
    assert packed.lm_head.inputs_twice and packed.lm_head.int4_rows == 2  # an 8-bit product costs two
    assert packed.typed_layers[0].qkv.int4 is None
    got = forced_logits(packed, prompt, tokens)
    error = float((got - expected).norm() / expected.norm())
    in_bfloat16 = Decoder(copy.deepcopy(model).to(torch.bfloat16), slots=2, positions=256)
    assert 0 < error <= float((forced_logits(in_bfloat16, prompt, tokens) - expected).norm() / expected.norm())
    # each row's highest logits are computed again on the dense weights: exactly the dense model's
    top = expected.topk(REFINED // 2, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top), expected.gather(-1, top), rtol=0, atol=1e-5)
    assert decode_greedy(packed, prompt, 16) == tokens
    # a bfloat16 model refines on the exact weights too, from the codes (its dense copy is rounded),
    # and its refined logits stay float32
    refined_bf16 = Decoder(copy.deepcopy(model).to(torch.bfloat16), slots=2, positions=256)
    refined_bf16.pack_int4(exact, rows=4, lossless_only=True)
    rows = torch.tensor([[0, 5, 9], [7, 300, 511]])
    assert torch.equal(refined_bf16.output.exact_rows(rows), exact["lm_head.weight"][rows])
    assert not torch.equal(refined_bf16.lm_head.weight[rows].float(), exact["lm_head.weight"][rows])
    assert forced_logits(refined_bf16, prompt, tokens).dtype == torch.float32
    # a step of a prompt's first chunk alone (a long prompt while nobody decodes) wants no logits
    with torch.inference_mode():
        assert refined_bf16.run(StepPlan(chunks=[Chunk(0, 0, prompt[:8], False)])).shape == (0, refined_bf16.vocab)
        split = refined_bf16.run(StepPlan(chunks=[Chunk(0, 8, prompt[8:], True)]))
        whole = refined_bf16.run(StepPlan(chunks=[Chunk(1, 0, prompt, True)]))
    torch.testing.assert_close(split, whole, rtol=0, atol=2e-2)
    # off the grid: dense with lossless_only, 8-bit groups otherwise
    other = {name: w.detach().float() for name, w in random_model(CONFIGS["llama"]).named_parameters()}
    auto = Decoder(random_model(CONFIGS["llama"]), slots=2, positions=256)
    auto.pack_int4(other, rows=4, lossless_only=True)
    assert auto.lm_head.int4 is None
    lossy = Decoder(random_model(CONFIGS["llama"]), slots=2, positions=256)
    lossy.pack_int4(other, rows=4, lossless_only=False)
    assert lossy.lm_head.inputs_twice


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread, as a worker on a 2-core host runs (where all the CPU kernels are used)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def vectorised_kernels(directory: Path) -> kernels.Kernels:
    """kernels.c built into ``directory``; the test is skipped where its products are not vectorised."""
    built = kernels.load(directory)
    if built is None or not built.int8_vectorised:
        pytest.skip("kernels.c's products are vectorised with AVX2 or AVX512-VNNI only")
    return built


def dense_reference(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The dense decoder's 16 greedy tokens after ``prompt`` and its logits at each of them."""
    dense = Decoder(model, slots=2, positions=256)
    tokens = decode_greedy(dense, prompt, 16)
    return tokens, forced_logits(dense, prompt, tokens)


def torch_but_the_products(decoder: Decoder) -> None:
    """Attention, RMS norms, the rotation and the MLP's activation back on torch's operators, the
    kernels.c products kept (the others' float32 rounding alone moves logits by 1e-4, more than the
    products' comparisons allow)."""
    decoder.attention = decoder._native_norm = None
    decoder._rope_store = None
    for layer in decoder.typed_layers:
        layer.native_norm = layer.native_activation = None


def test_on_one_thread_the_8_bit_output_layer_runs_through_kernels_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AVX2 or AVX512-VNNI and one thread, the output layer's 8-bit codes multiply inputs quantised to
    8 bits per 32 (``kernels.c``) instead of the 4-bit kernel run twice: about as close to the exact
    logits, the highest refined to exactly the dense model's, the same greedy tokens."""
    built = vectorised_kernels(shared_kernel_dir())
    model, exact = q8_output_model()
    prompt = list(range(10, 30))
    tokens, expected = dense_reference(model, prompt)
    twice = Decoder(model, slots=2, positions=256)
    twice.pack_int4(exact, rows=4, lossless_only=True)
    through_c = Decoder(model, slots=2, positions=256)
    through_c.pack_int4(exact, rows=4, lossless_only=True)
    through_c.use_kernels(built)
    torch_but_the_products(through_c)  # the output layer alone differs from the dense decoder
    calls = []
    weights_of = built.int8_weights

    def counted(codes: torch.Tensor, scales: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        product = weights_of(codes, scales)
        return lambda x: calls.append(1) or product(x)

    monkeypatch.setattr(built, "int8_weights", counted)
    with one_thread():
        got, baseline = forced_logits(through_c, prompt, tokens), forced_logits(twice, prompt, tokens)
        assert len(calls) == 1 + len(tokens)  # the prompt's last token, then every step
        assert decode_greedy(through_c, prompt, 16) == tokens
    error = float((got - expected).norm() / expected.norm())
    assert 0 < error <= 2 * float((baseline - expected).norm() / expected.norm())
    top = expected.topk(REFINED // 2, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top), expected.gather(-1, top), rtol=0, atol=1e-5)


def test_on_one_thread_the_4_bit_layers_run_through_kernels_c() -> None:
    """With AVX2 or AVX512-VNNI and one thread, the layers' 4-bit groups multiply inputs quantised to 8 bits
    per 32 (``kernels.c``, as llama.cpp does): about as close to the exact logits as torch's 4-bit
    kernel with its bfloat16 inputs (here closer: 4.3% against 5.3%; with either, this model's greedy
    tokens leave the dense model's within 16)."""
    built = vectorised_kernels(shared_kernel_dir())
    model, exact = q4_layers_model()
    prompt = list(range(10, 30))
    tokens, expected = dense_reference(model, prompt)
    with one_thread():
        through_torch = Decoder(model, slots=2, positions=256)
        assert through_torch.pack_int4(exact, rows=4, lossless_only=True)
        through_c = Decoder(model, slots=2, positions=256)
        through_c.use_kernels(built)  # before packing: it packs the kernels' copy too
        torch_but_the_products(through_c)  # the products alone differ
        assert through_c.pack_int4(exact, rows=4, lossless_only=True)
        assert all(layer.qkv.native is not None and layer.down.native is not None for layer in through_c.typed_layers)
        # packed for the kernel that runs the products only: no second copy for torch's kernel
        assert all(layer.qkv.int4 is None and layer.down.int4 is None for layer in through_c.typed_layers)
        assert through_torch.typed_layers[0].qkv.int4 is not None
        assert through_torch.typed_layers[0].qkv.native is None
        got, baseline = forced_logits(through_c, prompt, tokens), forced_logits(through_torch, prompt, tokens)
    assert not torch.equal(got, baseline)  # the products did run through kernels.c
    error = float((got - expected).norm() / expected.norm())
    assert 0 < error <= 2 * float((baseline - expected).norm() / expected.norm())


def test_a_steps_bytes_are_the_weights_its_products_read_and_its_positions_keys_and_values() -> None:
    """``Decoder.step_bytes`` (the bytes the benchmark reads beside a long generation's steps): dense
    weights as they are; 4-bit groups at 5/8 of a byte a weight (half a byte, and two 16-bit numbers a
    group of 32: torch's packing and kernels.c's alike); an 8-bit output layer through kernels.c at 17/16
    (a code, and a float16 scale a group); and the cache's bytes a position."""
    model, exact = q4_layers_model()
    config = model.config
    in_layers = [(name, p) for name, p in model.named_parameters() if name.startswith("model.layers.")]
    layers = sum(p.nbytes for _, p in in_layers)
    weights_in_products = sum(p.numel() for _, p in in_layers if p.dim() == 2)
    rest = model.lm_head.weight.nbytes + model.model.norm.weight.nbytes
    position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.hidden_size \
        // config.num_attention_heads * 2  # keys and values in float16
    dense = Decoder(model, slots=2, positions=256, cache_dtype=torch.float16)
    assert dense.cache.position_bytes == position
    assert dense.step_bytes(0) == layers + rest
    assert dense.step_bytes(100) == layers + rest + 100 * position
    in_4_bits = layers - 4 * weights_in_products + weights_in_products * 5 // 8
    through_torch = Decoder(model, slots=2, positions=256, cache_dtype=torch.float16)
    assert through_torch.pack_int4(exact, rows=4, lossless_only=True)
    assert through_torch.step_bytes(100) == in_4_bits + rest + 100 * position
    built = kernels.load(shared_kernel_dir())
    if built is None or not built.int8_vectorised:
        return  # kernels.c's products are vectorised with AVX2 or AVX512-VNNI only
    with one_thread():
        through_c = Decoder(model, slots=2, positions=256, cache_dtype=torch.float16)
        through_c.use_kernels(built)
        assert through_c.pack_int4(exact, rows=4, lossless_only=True)
        assert through_c.step_bytes(100) == in_4_bits + rest + 100 * position
        q8_model, q8_exact = q8_output_model()
        output = q8_model.lm_head.weight
        q8 = Decoder(q8_model, slots=2, positions=256)
        q8.use_kernels(built)
        q8.pack_int4(q8_exact, rows=4, lossless_only=True)
        in_8_bits = output.numel() * 17 // 16
        assert q8.output.decoding_bytes == in_8_bits  # before its first use too
        assert q8.output.packing == "8-bit groups through kernels.c"
        assert through_c.output.packing == "dense weights"  # off the 8-bit grid
        decode_greedy(q8, list(range(10, 20)), 2)
        assert q8.output.decoding_bytes == in_8_bits
        assert q8.step_bytes(0) == sum(p.nbytes for _, p in q8_model.named_parameters()) - output.nbytes \
            - q8_model.model.embed_tokens.weight.nbytes + in_8_bits


def run_plans(decoder: Decoder, prompt: list[int]) -> list[torch.Tensor]:
    """The logits of a run of steps: a prompt in chunks, decoding beside another prompt's chunks (a
    dummy row 0 among them), a chunk too many rows for the 4-bit products (8), then decoding alone."""
    with torch.inference_mode():
        plans = [StepPlan(chunks=[Chunk(1, 0, prompt[:5], False)]),
                 StepPlan(chunks=[Chunk(1, 5, prompt[5:10], True)]),
                 StepPlan(feeds=[Feed(1, 7, 10)], chunks=[Chunk(2, 0, prompt[:4], False)]),
                 StepPlan(feeds=[Feed(1, 8, 11)], chunks=[Chunk(2, 4, prompt[4:16], True)]),
                 StepPlan(feeds=[Feed(1, 9, 12), Feed(2, 3, 16)])]
        plans += [StepPlan(feeds=[Feed(1, 10 + i, 13 + i), Feed(2, 4 + i, 17 + i)]) for i in range(6)]
        return [decoder.run(plan) for plan in plans]


@pytest.mark.parametrize(("dtype", "cache"), [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                              (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_a_steps_layers_run_in_one_kernels_c_call_as_in_the_python_loop(dtype: torch.dtype, cache: torch.dtype,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every part of the layers runs through kernels.c (4-bit products for all of a step's rows),
    they run in one call (``workers.model.cpu.layerstep``): every step's logits are the Python loop's bit for
    bit, prompt chunks and decoding rows alike; a step of more rows takes the loop."""
    assert_one_call_is_the_loop(vectorised_kernels(shared_kernel_dir()), dtype, cache, monkeypatch)


@pytest.mark.parametrize(("dtype", "cache"), [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_a_steps_layers_built_for_avx2_run_in_one_call_as_in_the_python_loop(
        dtype: torch.dtype, cache: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with kernels.c built for AVX2 without AVX512 (``-march=haswell``: products in blocks of
    8, the AVX2 heads) on whichever x86 CPU runs the tests: the AVX2 EPYC's float32 model with a
    float16 cache, and bfloat16."""
    built = built_for("haswell", tmp_path, monkeypatch)
    assert built is not None and built.product_block == 8
    assert_one_call_is_the_loop(built, dtype, cache, monkeypatch)


def assert_one_call_is_the_loop(built: kernels.Kernels, dtype: torch.dtype, cache: torch.dtype,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    model, exact = q4_layers_model()
    model = model.to(dtype)
    prompt = list(range(10, 30))
    calls = one_calls(monkeypatch)
    with one_thread():
        decoders = []
        for _ in range(2):
            decoder = Decoder(model, slots=3, positions=256, cache_dtype=cache)
            decoder.use_kernels(built)  # before packing: it packs the kernels' copy
            assert decoder.pack_int4(exact, rows=8, lossless_only=True)
            decoders.append(decoder)
        one, loop = decoders
        assert one._layer_step_of() is not None
        assert one.one_call_rows == 8  # the 4-bit products' rows: the scheduler keeps chunks within them
        with monkeypatch.context() as threads:  # torch on more threads than the kernels beat: no one call
            threads.setitem(kernels.MAX_THREADS, "int8", 0)
            assert one.one_call_rows == 0
        with monkeypatch.context() as python_loop:  # the loop decoder finds no one call at its first step
            python_loop.setattr(loop, "_layer_step_of", lambda: None)
            expected = run_plans(loop, prompt)
        assert not calls and loop.one_call_rows == 0
        got = run_plans(one, prompt)
        assert calls == [5, 5, 6, 3, 3, 3, 3, 3, 3, 3]  # all but the 14-row step
        for step, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(a, b), f"step {step}"
        for decoder in decoders:  # a position past the cache: refused alike, by the one call too
            with pytest.raises(ValueError, match="outside"):
                decoder.run(StepPlan(feeds=[Feed(1, 5, 256)]))
        assert len(calls) == 11
        torch_but_the_products(one)  # the attention, norms, rotation and activation back on torch
        assert one._layer_step_of() is None


def test_the_cpu_precision_is_measured_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[torch.dtype] = []
    seconds = precision._seconds

    def counted(dtype: torch.dtype, rounds: int = 5) -> float:
        measured.append(dtype)
        return seconds(dtype, rounds=1)

    monkeypatch.setattr(precision, "_seconds", counted)
    first = precision.cpu_dtype(tmp_path)
    assert sorted(map(str, measured)) == ["torch.bfloat16", "torch.float32"]
    assert precision.cpu_dtype(tmp_path) == first and len(measured) == 2  # read from the cache
    assert precision.cpu_signature() in (tmp_path / "precision.json").read_text()


_MEASURE_IN_A_PROCESS = """
import os, sys, time
from pathlib import Path
from workers.model import precision

def measure() -> str:
    with open(Path(sys.argv[1]) / "measured", "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(2)  # longer than the other processes take to reach the lock
    return str(os.getpid())

print(precision._cached(Path(sys.argv[1]), "a signature", measure))
"""


def test_workers_starting_together_measure_once(tmp_path: Path) -> None:
    """Three processes ask for the same figure at once: one measures, the others wait and read it."""
    processes = [subprocess.Popen([sys.executable, "-c", _MEASURE_IN_A_PROCESS, str(tmp_path)], stdout=subprocess.PIPE,
                                  text=True) for _ in range(3)]
    answers = [process.communicate(timeout=120)[0].strip() for process in processes]
    assert all(process.returncode == 0 for process in processes)
    measured = (tmp_path / "measured").read_text().split()
    assert len(measured) == 1 and answers == measured * 3
    assert json.loads((tmp_path / "precision.json").read_text()) == {"a signature": measured[0]}


def test_a_gguf_is_converted_under_its_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``converted_gguf`` converts holding the model's lock (workers starting together convert once),
    and not again once converted."""
    converted: list[Path] = []

    def convert(spec: object, target: Path) -> None:
        with open(target.with_name(f"{target.name}.lock")) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the conversion
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"")
        converted.append(target)

    monkeypatch.setattr(loader, "_convert", convert)
    first = loader.converted_gguf(SMOLLM2, tmp_path)
    assert loader.converted_gguf(SMOLLM2, tmp_path) == first and converted == [first]


def fake_timings(monkeypatch: pytest.MonkeyPatch, name: str,
                 timings: Callable[[int], tuple[float, float]]) -> list[int]:
    """``precision.<name>`` answering ``timings(rows)``; returns the row counts it is asked for."""
    measured: list[int] = []

    def timed(dtype: torch.dtype, rows: int, rounds: int = 5, native: object = None,
              other: object = None) -> tuple[float, float]:
        measured.append(rows)
        return timings(rows)

    monkeypatch.setattr(precision, name, timed)
    return measured


def test_how_many_rows_4_bit_products_pay_for_is_measured_once(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real = precision._product_seconds
    # 4-bit faster up to 8 rows, then slower
    measured = fake_timings(monkeypatch, "_product_seconds", lambda rows: (1.0, 0.5) if rows <= 8 else (1.0, 2.0))
    assert precision.int4_rows(tmp_path, torch.float32) == 8 and measured == [1, 2, 4, 8, 16]
    assert precision.int4_rows(tmp_path, torch.float32) == 8 and len(measured) == 5  # read from the cache
    monkeypatch.setattr(precision, "_product_seconds", lambda dtype, rows, native=None, other=None: (1.0, 1.5))
    assert precision.int4_rows(tmp_path, torch.bfloat16) == 0  # never faster: never packed
    dense, packed = real(torch.float32, 2, rounds=1)  # the real measurement runs both kinds of layer
    assert dense > 0 and packed > 0
    native = kernels.load(shared_kernel_dir())
    assert native is not None
    # figures for kernels.c's products are kept apart from those for torch's kernel
    assert precision.int4_rows(tmp_path, torch.float32, native) == 0
    assert len(json.loads((tmp_path / "precision.json").read_text())) == 3
    # within NATIVE_TIE of the dense products, kernels.c's still pay (their step runs in one call);
    # torch's kernel's do not
    fake_timings(monkeypatch, "_product_seconds", lambda rows: (1.0, 1.0 if rows <= 4 else 1.05))
    assert precision.int4_rows(tmp_path, torch.float16, native) == 32
    assert precision.int4_rows(tmp_path, torch.float16) == 0
    fake_timings(monkeypatch, "_product_seconds", lambda rows: (1.0, 1.05 if rows <= 4 else 1.2))
    assert precision.int4_rows(tmp_path / "again", torch.float16, native) == 4
    assert all(packed.native is not None for _, packed in precision._layers(torch.float32, 2, native))
    dense, packed = real(torch.float32, 2, rounds=1, native=native)
    assert dense > 0 and packed > 0


def test_the_products_are_timed_past_the_largest_cache(tmp_path: Path) -> None:
    """The 4-bit against dense measurements read twice the largest cache between runs (a 480 MB L3
    held their layers, and dense products looked faster than they are in a model's step)."""
    for index, size in enumerate(["48K", "2048K", "491520K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert precision.last_level_cache(tmp_path) == 491520 << 10
    (tmp_path / "index3").mkdir()
    (tmp_path / "index3" / "size").write_text("1G\n")
    assert precision.last_level_cache(tmp_path) == 1 << 30
    assert precision.last_level_cache(tmp_path / "absent") == 32 << 20  # where Linux lists none
    assert precision.last_level_cache() >= 1 << 20  # this machine's


def test_the_data_read_between_timed_runs_stays_within_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    page = os.sysconf("SC_PAGE_SIZE")

    def free(size: int) -> None:  # the memory the OS reports free
        monkeypatch.setattr(os, "sysconf", lambda name: size // page if name == "SC_AVPHYS_PAGES" else page)

    free(64 << 30)
    monkeypatch.setattr(precision, "last_level_cache", lambda: 64 << 20)
    assert precision._other_data().numel() * 4 == 128 << 20  # twice the last-level cache
    monkeypatch.setattr(precision, "last_level_cache", lambda: 8 << 30)
    assert precision._other_data().numel() * 4 == 1 << 30  # at most a gigabyte
    free(40 << 20)
    assert precision._other_data().numel() * 4 == 10 << 20  # at most a quarter of what is free


def test_each_timed_run_comes_after_the_other_data_is_read() -> None:
    events: list[str] = []

    class Other:
        def sum(self) -> None:
            events.append("read")

    precision._best_of(2, lambda: events.append("dense"), lambda: events.append("4-bit"), other=cast(Tensor, Other()))
    assert events == ["read", "dense", "read", "4-bit"] * 2


def test_whether_chunks_take_decoding_rows_along_is_measured_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = precision._merge_seconds
    # merged cheaper up to 2 decoding rows
    measured = fake_timings(monkeypatch, "_merge_seconds", lambda rows: (1.0, 1.5) if rows <= 2 else (1.0, 0.5))
    assert precision.merge_rows(tmp_path, torch.float32, packed_rows=8) == 2 and measured == [1, 2, 4]
    assert precision.merge_rows(tmp_path, torch.float32, packed_rows=8) == 2 and len(measured) == 3  # cached
    assert precision.merge_rows(tmp_path, torch.float32, packed_rows=1) == 1  # never beyond the 4-bit rows
    assert precision.merge_rows(tmp_path, torch.bfloat16, packed_rows=0) == 0 and len(measured) == 3
    merged, apart = real(torch.float32, 2, rounds=1)  # the real measurement runs both ways
    assert merged > 0 and apart > 0


@pytest.mark.slow  # torch.compile: most of a minute
@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch")  # torch's own imports while compiling
async def test_the_compiled_step_decodes_as_the_eager_one(tiny: loader.LoadedModel) -> None:
    from workers.main import compiled_cache

    compiled_cache(Path(load_settings().model_cache))  # a second run reads the compiled step from disk
    spec = msgspec.structs.replace(TINY_RANDOM, max_batch_size=2)  # two buckets to compile; the third job waits
    loaded = loader.LoadedModel(spec, tiny.model, tiny.card, tiny.device)
    jobs = [([1, 20, 30, 40], 30, 0.0), ([5, 6, 7], 12, 0.0), ([8, 9], 20, 0.05)]
    compiled = await run_engine(Engine(loaded, compile=True), jobs)
    eager = await run_engine(Engine(loaded, compile=False), jobs)
    assert [sink.tokens for sink in compiled] == [sink.tokens for sink in eager]
    assert all(len(sink.tokens) == budget for sink, (_, budget, _) in zip(compiled, jobs, strict=True))
