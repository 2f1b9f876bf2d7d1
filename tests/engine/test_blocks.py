"""Products on a GGUF file's own blocks (``blocks.c``) against gguf-py's de-quantisation, and models served
on them against transformers on the same file, de-quantised."""

import logging
import os
import signal
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lmsp_core.requests.catalog import ModelSpec
from tests.engine import ggufmodels
from tests.engine.support import one_calls, shared_kernel_dir
from tests.support import tiny_model_dir
from workers.model import build, loader
from workers.model.cpu import blocks
from workers.model.cpu.blocks import BlockTensor
from workers.model.gguf import ModelFileError
from workers.model.plan import Chunk, Feed, StepPlan

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]


@pytest.fixture(scope="module")
def built() -> blocks.Blocks:
    products = blocks.load(shared_kernel_dir())
    assert products is not None, "blocks.c did not build"
    return products


def tensor(kind: Q, rows: int, cols: int, seed: int = 0) -> BlockTensor:
    data = ggufmodels._blocks(np.random.default_rng(seed), kind, rows, cols)
    return BlockTensor(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1), int(kind), rows, cols)


def dequantized(weights: BlockTensor) -> np.ndarray:
    values = gguf.dequantize(weights.data, Q(weights.type))
    return np.asarray(values, dtype=np.float64).reshape(weights.rows, weights.cols)


@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("plain", [False, True], ids=["vectorised", "plain C"])
def test_a_product_is_the_quantised_inputs_times_the_weights(built: blocks.Blocks, kind: Q, plain: bool) -> None:
    """Exact but for float32 sums (and Q4_1's and Q5_1's input sums, in float16 as llama.cpp keeps
    them): 1 row (decoding), 3 and 5 (a batch, past one pass of 4), 70 (a prompt, past one tile)."""
    weights = tensor(kind, 40, 512)
    reference = dequantized(weights)
    built.plain(plain)
    try:
        for rows in (1, 3, 5, 70):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            quantized = built.quantized(x, weights.type).double().numpy()
            got = built.product([weights])(x).double().numpy()
            # within float32's sums of the products' sizes (and float16's, for the sums kept in it)
            assert (np.abs(got - quantized @ reference.T) <= 1e-3 * (np.abs(quantized) @ np.abs(reference).T)).all()
    finally:
        built.plain(False)


@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_quantised_inputs_stay_within_a_step_of_their_block(built: blocks.Blocks, kind: Q) -> None:
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    block = blocks.BLOCK_BYTES[int(kind)][0]
    quantized = built.quantized(x, int(kind))
    widest = x.abs().view(3, -1, block).amax(-1, keepdim=True)
    # half a step, the step rounded to float16 where llama.cpp keeps it so (127 steps of 2**-11)
    assert ((quantized - x).abs().view(3, -1, block) <= widest / 127 * 0.57 + 1e-6).all()


def test_fused_parts_and_threads_give_the_same_outputs(built: blocks.Blocks) -> None:
    parts = [tensor(Q.Q4_K, 48, 512, 1), tensor(Q.Q6_K, 16, 512, 2), tensor(Q.Q8_0, 20, 512, 3)]
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([built.product([part])(x) for part in parts], dim=1)
    try:
        assert built.use_threads(2) == 2
        assert torch.equal(built.product(parts)(x), alone)
    finally:
        built.use_threads(1)
    assert torch.equal(built.product(parts)(x), alone)


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16], ids=lambda kind: kind.name)
def test_float_rows_are_taken_four_at_a_time_in_place(built: blocks.Blocks, kind: Q) -> None:
    """F16 and BF16 products take four rows a call where a part's rows come in fours and start on one, on
    the file's own bytes; other parts keep one row a call. Inputs of 516 (a tail past the last 8), up to
    8 rows (two passes of four input rows with AVX512); parts of 36 and 100 rows: a thread's share of 64
    rows takes rows from both, the next one a quarter of 16 a stream."""
    weights = tensor(kind, 40, 516)
    fours = built.arranged(weights, 0)
    assert fours.type == blocks.FOURS[int(kind)] and fours.data is weights.data
    assert built.arranged(tensor(kind, 30, 516), 0).type == kind, "rows not in fours"
    assert built.arranged(weights, 2).type == kind, "a part placed off the fours"
    assert torch.equal(built.rows(fours, torch.tensor([39, 0])), built.rows(weights, torch.tensor([39, 0])))
    parts = [tensor(kind, 30, 516, 1), tensor(kind, 40, 516, 2), tensor(kind, 8, 516, 3)]
    x = torch.randn(8, 516, generator=torch.Generator().manual_seed(4))
    try:
        for plain in (False, True):
            built.plain(plain)
            spanning = [tensor(kind, 36, 516, 5), tensor(kind, 100, 516, 6)]
            for together, types in ((parts, [kind] * 3), (parts[1:], [blocks.FOURS[int(kind)]] * 2),
                                    (spanning, [blocks.FOURS[int(kind)]] * 2)):
                product = built.product(together)
                assert list(product.types) == types
                reference = np.concatenate([dequantized(part) for part in together])
                for rows in (1, 2, 3, 5, 8):
                    got = product(x[:rows]).double().numpy()
                    assert np.allclose(got, x[:rows].double().numpy() @ reference.T, rtol=1e-5, atol=1e-4)
    finally:
        built.plain(False)


def test_a_forked_child_runs_its_products_without_its_parents_threads(built: blocks.Blocks) -> None:
    """A child forked after the pool started has none of its threads: its products must not wait for them."""
    weights, x = tensor(Q.Q4_K, 64, 512), torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    try:
        built.use_threads(2)
        want = built.product([weights])(x)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's verdict is its exit status
            os._exit(0 if torch.equal(built.product([weights])(x), want) else 1)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung or computed otherwise"
    finally:
        built.use_threads(1)


def test_rows_come_back_as_the_file_holds_them(built: blocks.Blocks) -> None:
    for kind in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0):
        weights = tensor(kind, 30, 512)
        ids = torch.tensor([[3, 0], [29, 3]])
        rows = built.rows(weights, ids)
        assert rows.shape == (2, 2, 512)
        assert np.array_equal(rows.view(4, 512).numpy(), dequantized(weights)[[3, 0, 29, 3]].astype(np.float32))
    with pytest.raises(ValueError, match="outside"):
        built.rows(weights, torch.tensor([30]))


def test_q4_k_rows_are_interleaved_by_eights_and_their_mapped_pages_given_back(built: blocks.Blocks,
                                                                                 tmp_path: Path) -> None:
    """A product interleaves a Q4_K tensor's rows in memory of its own (when they come in eights), then
    drops the mapped file's pages it read from this process; a copy of its own is never dropped."""
    weights = tensor(Q.Q4_K, 4096, 512)
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(10000) + weights.data.tobytes())  # as in a file, after other bytes
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    mapped = BlockTensor(whole[10000:].reshape(4096, -1), int(Q.Q4_K), 4096, 512)
    assert int(np.asarray(mapped.data).sum()) == int(weights.data.sum())  # every page read in
    before = _file_pages_kb()
    interleaved = built.interleaved(mapped)
    assert interleaved.type == blocks.Q4_K_X8 and interleaved.data.base is not mapped.data.base
    assert _file_pages_kb() < before - weights.nbytes // 2048, "the file's pages stay in this process"
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(built.product([interleaved])(x), built.product([weights])(x), rtol=0, atol=0)
    assert np.array_equal(np.asarray(mapped.data), weights.data), "read again, the file's bytes come back"
    copy = weights.data.copy()
    built.interleaved(BlockTensor(copy, int(Q.Q4_K), 4096, 512))
    assert np.array_equal(copy, weights.data)
    assert built.interleaved(tensor(Q.Q4_K, 12, 512)).type == Q.Q4_K, "rows not in eights stay as they are"
    with pytest.raises(ValueError, match="outside"):  # rows of interleaved blocks are not looked up
        built.rows(interleaved, torch.tensor([0]))


def _file_pages_kb() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("RssFile:")).split()[1])


def test_a_product_refuses_what_it_does_not_take(built: blocks.Blocks) -> None:
    with pytest.raises(ValueError, match="no product"):
        BlockTensor(np.zeros((2, 110), dtype=np.uint8), int(Q.Q3_K), 2, 256)
    with pytest.raises(ValueError, match="inputs of 256"):
        built.product([tensor(Q.Q4_K, 4, 512)])(torch.zeros(1, 256))


# --- models on their file's blocks ----------------------------------------------------------------------

FILES = {
    # Q4_K_M's mix: the layers in Q4_K, values and the MLP's down product in Q6_K, embeddings in Q6_K
    "llama Q4_K_M": dict(architecture="llama", types={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}),
    "qwen2 Q8_0, biases": dict(architecture="qwen2", matrices=Q.Q8_0, embeddings=Q.Q8_0, output=Q.Q8_0),
    "qwen3 Q5_K, q/k norms": dict(architecture="qwen3", matrices=Q.Q5_K, shape=ggufmodels.Shape(head_dim=128)),
    "llama F16 and BF16": dict(architecture="llama", matrices=Q.F16, embeddings=Q.BF16, types={"ffn_up": Q.BF16}),
    "llama Q3_K, de-quantised": dict(architecture="llama", matrices=Q.Q3_K),
}


def spec_of(path: Path) -> ModelSpec:
    return ModelSpec(id=path.stem, source=f"gguf-file:{path}", context_window=256, max_output_tokens=64,
                     capabilities=[], max_batch_size=4)


class FloatProduct:
    """A product on the same blocks, de-quantised, with float32 inputs: what the decoder computes but
    for the inputs' quantisation."""

    def __init__(self, parts: list[BlockTensor]) -> None:
        self.weights = torch.cat([torch.from_numpy(dequantized(part).astype(np.float32)) for part in parts])
        self.nbytes, self.kind = self.weights.nbytes, "float32"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weights.T


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each model file once, and a model cache shared by its two tests (its tokenizer read once)."""
    directory = tmp_path_factory.mktemp("gguf")
    for name, arguments in FILES.items():
        ggufmodels.write(directory / f"{name.split()[0]}-{len(name)}.gguf", **arguments)  # type: ignore[arg-type]
    (directory / "cache" / "kernels").mkdir(parents=True)
    for library in shared_kernel_dir().glob("*.so"):  # the session's builds: no compiler run here
        (directory / "cache" / "kernels" / library.name).symlink_to(library)
    return directory


@pytest.mark.parametrize("inputs", ["quantised", "float"])
@pytest.mark.parametrize("name", FILES)
def test_a_gguf_model_on_its_blocks_agrees_with_transformers(name: str, inputs: str, files: Path,
                                                             caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With float inputs, the decoder on the file's blocks is transformers' model (queries and keys
    back in its order, biases, norms); with inputs quantised to 8 bits, as llama.cpp's are, the
    logits move by a few percent of the largest through these random layers."""
    if inputs == "float":
        monkeypatch.setattr(blocks.Blocks, "product", lambda self, parts: FloatProduct(parts))
    path, cache = files / f"{name.split()[0]}-{len(name)}.gguf", files / "cache"
    with caplog.at_level(logging.WARNING, logger="workers.model.gguf"):
        loaded = loader.load(spec_of(path), cache)
    assert loaded.blocks is not None
    assert ("de-quantised to float32" in caplog.text) == name.endswith("de-quantised")
    assert not list(cache.rglob("*.safetensors")), "nothing but the tokenizer and config is written"
    decoder = build.slot_model(loaded, compile=False)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokens = [1, 500, 42, 2000, 123, 9]
    with torch.inference_mode():
        decoder.run(StepPlan(chunks=[Chunk(slot=1, start=0, tokens=tokens[:4], last=False)]))
        logits = [decoder.run(StepPlan(chunks=[Chunk(slot=1, start=4, tokens=tokens[4:], last=True)]))[0]]
        for token in (77, 1999):
            tokens.append(token)
            logits.append(decoder.run(StepPlan(feeds=[Feed(slot=1, token=token, position=len(tokens) - 1)]))[0])
        want = reference(torch.tensor([tokens])).logits[0, 5:]
    tolerance = 5e-2 if inputs == "quantised" else 1e-3  # float inputs: the float16 cache's rounding
    for got, expected in zip(logits, want, strict=True):
        assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("name", FILES)
def test_a_gguf_models_layers_run_in_one_call_as_in_the_python_loop(name: str, files: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every layer's four products run on the file's blocks without biases and its queries and
    keys are not normed, a step's layers run in one kernels.c call (``layerstep``): every step's logits
    are the Python loop's bit for bit, prompt chunks and decoding rows alike; float rows take at most
    63 rows there (more go through torch's product on float32 tiles, in the loop)."""
    path, cache = files / f"{name.split()[0]}-{len(name)}.gguf", files / "cache"
    one, loop = (build.slot_model(loader.load(spec_of(path), cache), compile=False) for _ in range(2))
    if name.startswith("qwen"):  # biases, normed queries and keys
        assert one._layer_step_of() is None
        return
    floats = "F16" in name or "de-quantised" in name  # Q3_K: float32 rows
    layer_step = one._one_call()
    assert layer_step is not None and layer_step.limit == (63 if floats else blocks.ALL_ROWS)
    assert one.one_call_rows == 0  # no jump in a step's cost for the scheduler to keep chunks from
    calls = one_calls(monkeypatch)
    monkeypatch.setattr(loop, "_layer_step_of", lambda: None)
    prompt = list(range(100, 180))
    plans = [StepPlan(chunks=[Chunk(1, 0, prompt[:5], False)]), StepPlan(chunks=[Chunk(1, 5, prompt[5:75], True)]),
             StepPlan(feeds=[Feed(1, 7, 75)], chunks=[Chunk(2, 0, prompt[:4], True)])]
    plans += [StepPlan(feeds=[Feed(1, 8 + i, 76 + i), Feed(2, 3 + i, 4 + i)]) for i in range(3)]
    with torch.inference_mode():
        expected = [loop.run(plan) for plan in plans]
        assert not calls
        got = [one.run(plan) for plan in plans]
    assert calls == ([5] if floats else [5, 70]) + [6, 3, 3, 3]
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_a_truncated_gguf_file_is_named(tmp_path: Path) -> None:
    path = ggufmodels.write(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(ModelFileError, match=r"cut\.gguf"):
        loader.load(spec_of(cut), tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_directory_is_served_in_its_dtype(dtype: str, tmp_path: Path) -> None:
    """No float32 copy: the decoder's products read the model's own bfloat16 or float16 weights."""
    path = tiny_model_dir(tmp_path / "half", dtype=dtype)
    weights = load_file(path / "model.safetensors")
    save_file({name: t.to(getattr(torch, dtype)) for name, t in weights.items()}, path / "model.safetensors")
    spec = ModelSpec(id="half", source=f"hf-dir:{path}", context_window=256, max_output_tokens=64,
                     capabilities=[], max_batch_size=2)
    loaded = loader.load(spec, tmp_path / "cache")
    assert loaded.blocks is not None
    assert all(p.is_meta for p in loaded.model.parameters() if p.dim() == 2), "no copy of the matrices"
    decoder = build.slot_model(loaded, compile=False)
    assert "GGUF blocks (" + ("BF16" if dtype == "bfloat16" else "F16") + ")" in decoder.output.packing
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).float().eval()
    tokens = [1, 500, 42, 2000, 123, 9, 77]
    with torch.inference_mode():
        got = decoder.run(StepPlan(chunks=[Chunk(slot=0, start=0, tokens=tokens, last=True)]))[0]
        want = reference(torch.tensor([tokens])).logits[0, -1]
    assert (got - want).abs().max() <= 3e-2 * want.abs().max()
    assert int(got.argmax()) == int(want.argmax())
