"""The CPU kernels (workers/model/cpu/kernels.c) against torch: decoding rows' attention and the 8-bit product."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional

from lmsp_core.settings import load_settings
from tests.engine.support import built_for, shared_kernel_dir
from workers.model.cpu import attention, kernels
from workers.model.cpu.groups import Groups4, Groups8, in_blocks, scales_in_blocks
from workers.model.layers import rotate


@pytest.fixture(scope="module")
def built() -> kernels.Kernels:
    loaded = kernels.load(shared_kernel_dir())  # the session's workers' build
    assert loaded is not None
    return loaded


CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tolerance_of(dtype: torch.dtype) -> float:
    """Of a result in ``dtype``: float32's arithmetic, else the result's rounding (bfloat16's, also of
    the probabilities in a chunk's blocks, as torch's own CPU attention rounds them)."""
    return {torch.float32: 1e-5, torch.float16: 2e-3}.get(dtype, 1e-2)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: list[int],
              limits: list[int]) -> torch.Tensor:
    """torch's attention in float64 of each row over its slot, up to its limit (zeros below 0)."""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    out = torch.zeros(rows, heads, head_dim, dtype=torch.float64)
    for r, (slot, limit) in enumerate(zip(slots, limits, strict=True)):
        if limit >= 0:
            out[r] = functional.scaled_dot_product_attention(
                q[r, :, None].double(), keys[slot, :, :limit + 1].double(), values[slot, :, :limit + 1].double(),
                enable_gqa=heads != kv_heads)[:, 0]
    return out.flatten(1)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"),
                         [(3, 3, 64), (2, 4, 128), (2, 1, 64), (1, 2, 128), (2, 5, 64), (2, 2, 16), (4, 1, 32)])
def test_the_kernel_attends_as_torch_does(built: kernels.Kernels, dtype: torch.dtype, kv_heads: int, group: int,
                                          head_dim: int) -> None:
    # decoding rows (row r: slot r), then a chunk of three tokens of slot 4 at positions 120-122
    positions, slots, limits = 300, [0, 1, 2, 3, 4, 4, 4], [299, 0, 136, -1, 120, 121, 122]
    kernel = attention.decode_attention(built, group, head_dim, positions)
    assert kernel is not None
    generator = torch.Generator().manual_seed(head_dim)
    keys, values = (torch.randn(5, kv_heads, positions, head_dim, generator=generator).to(dtype) for _ in range(2))
    fused = torch.randn(len(limits), kv_heads * (group + 2), head_dim, generator=generator).to(dtype)
    q = fused[:, :kv_heads * group]  # a view, as the decoder's queries are (rows further apart)
    assert kernel.supports(q, keys)
    got = kernel(q, keys, values, np.asarray(slots), np.asarray(limits))
    assert got.dtype == dtype and got.shape == (len(limits), kv_heads * group * head_dim)
    tolerance = tolerance_of(dtype)
    expected = reference(q, keys, values, slots, limits)
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    assert not got[3].any()  # a row below 0 attends to nothing


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 4, 128), (2, 1, 64)])
def test_decoding_rows_of_every_length_around_the_tiles_attend_as_torch_does(
        built: kernels.Kernels, dtype: torch.dtype, kv_heads: int, group: int, head_dim: int) -> None:
    """Lengths below, at and past the 16 keys a bfloat16 head scores at once with AVX512-BF16
    (kernels.c, "dp_head"), the last row ending at its slot's last position, in the cache's last slot
    (nothing after it to read)."""
    lengths = [1, 2, 3, 15, 16, 17, 31, 32, 33, 48, 49]
    positions = max(lengths)
    kernel = attention.decode_attention(built, group, head_dim, positions)
    assert kernel is not None
    generator = torch.Generator().manual_seed(len(lengths) * head_dim + group)
    keys, values = (torch.randn(len(lengths), kv_heads, positions, head_dim, generator=generator).to(dtype)
                    for _ in range(2))
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator).to(dtype)
    slots, limits = list(range(len(lengths))), [length - 1 for length in lengths]
    got = kernel(q, keys, values, np.asarray(slots), np.asarray(limits))
    tolerance = tolerance_of(dtype)
    torch.testing.assert_close(got.double(), reference(q, keys, values, slots, limits), rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128), (1, 7, 64)])
def test_prompt_chunks_attend_as_blocks_as_torch_does(built: kernels.Kernels, dtype: torch.dtype, kv_heads: int,
                                                      group: int, head_dim: int) -> None:
    """A chunk's rows attend as blocks of up to 16 (kernels.c, "Blocks"): a decoding row, then a
    40-token chunk from the start of slot 1 (blocks of 16, 16 and 8), a 5-token chunk of slot 2 right
    beside it (a block ends where the slot changes) and a 19-token chunk ending at the last position
    of slot 3 (its last tile of keys is partial, with nothing after it to read)."""
    positions = 91
    chunks = [(1, 0, 40), (2, 60, 65), (3, positions - 19, positions)]
    slots = [0] + [slot for slot, start, end in chunks for _ in range(start, end)]
    limits = [50] + [position for _, start, end in chunks for position in range(start, end)]
    kernel = attention.decode_attention(built, group, head_dim, positions)
    assert kernel is not None
    generator = torch.Generator().manual_seed(group)
    keys, values = (torch.randn(4, kv_heads, positions, head_dim, generator=generator).to(dtype) for _ in range(2))
    q = torch.randn(len(limits), kv_heads * group, head_dim, generator=generator).to(dtype)
    got = kernel(q, keys, values, np.asarray(slots), np.asarray(limits))
    tolerance = tolerance_of(dtype)
    torch.testing.assert_close(got.double(), reference(q, keys, values, slots, limits), rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_long_rows_attend_with_the_helper_thread_as_without_it(built: kernels.Kernels, dtype: torch.dtype) -> None:
    """With the helper thread on (kernels.c, "The helper"), the key heads of decoding rows at least the
    length it is given are items that either thread runs: bit for bit the attention without it, in
    twenty calls (whichever thread ran which head), with the next layer's cache read ahead or not (a
    step's last layer); a dummy row and a chunk's rows beside them as before."""
    positions, kv_heads, group, head_dim = 1400, 3, 3, 64
    kernel = attention.decode_attention(built, group, head_dim, positions)
    assert kernel is not None
    generator = torch.Generator().manual_seed(1400)
    keys, values, following_keys, following_values = (
        torch.randn(4, kv_heads, positions, head_dim, generator=generator).to(dtype) for _ in range(4))
    # decoding rows of 1,400 and 700 positions, a dummy, then a chunk of slot 3
    slots, limits = np.asarray([0, 1, 2, 3, 3, 3]), np.asarray([1399, 699, -1, 100, 101, 102])
    q = torch.randn(len(limits), kv_heads * group, head_dim, generator=generator).to(dtype)
    alone = kernel(q, keys, values, slots, limits)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker that runs the helper (torch's idle threads would keep it off the core)
    try:
        assert built.configure_helper(1)
        runs = [kernel(q, keys, values, slots, limits, (following_keys, following_values) if i % 2 else None)
                for i in range(20)]
    finally:
        built.configure_helper(0)
        torch.set_num_threads(threads)
    assert all(torch.equal(run, alone) for run in runs)
    tolerance = tolerance_of(dtype)
    torch.testing.assert_close(alone.double(), reference(q, keys, values, list(slots), list(limits)),
                               rtol=tolerance, atol=tolerance)


def test_the_helper_runs_only_where_allowed_and_torch_leaves_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LMSP_ATTENTION_HELPER`` (``kernels.allow_helper``, from ``loader.limit_threads``) and torch's
    threads decide whether attention takes the helper thread."""
    monkeypatch.setattr(kernels, "_helper_allowed", True)
    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(cores)
        assert not kernels.helper_fits()  # no core left over
        if cores > 1:
            torch.set_num_threads(cores - 1)
            kernels.allow_helper(load_settings({}).attention_helper)
            assert kernels.helper_fits()
            kernels.allow_helper(load_settings({"LMSP_ATTENTION_HELPER": "false"}).attention_helper)
            assert not kernels.helper_fits()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 20])  # a decoding row's head, a chunk's block
def test_scores_far_apart_attend_as_torch_does(built: kernels.Kernels, rows: int) -> None:
    """Scores hundreds apart: the softmax's exponentials (``exp16`` with AVX512) underflow to nothing
    for all but the highest, and lengths that end mid-vector (the last 16 partly masked)."""
    positions, kv_heads, group, head_dim = 77, 2, 3, 64
    kernel = attention.decode_attention(built, group, head_dim, positions)
    assert kernel is not None
    generator = torch.Generator().manual_seed(rows)
    keys, values = (torch.randn(1, kv_heads, positions, head_dim, generator=generator) for _ in range(2))
    q = torch.randn(rows, kv_heads * group, head_dim, generator=generator) * 40  # scores' spread about 40
    slots, limits = [0] * rows, list(range(positions - rows, positions))
    got = kernel(q, keys, values, np.asarray(slots), np.asarray(limits))
    torch.testing.assert_close(got.double(), reference(q, keys, values, slots, limits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "n"), [(1, 576), (5, 64), (3, 33)])
def test_the_rms_norm_is_torchs(built: kernels.Kernels, rows: int, n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    x, weight = torch.randn(rows, n, generator=generator) * 3, torch.randn(n, generator=generator)
    got = built.rms_norm(x, weight, 1e-5)
    expected = functional.rms_norm(x.double(), (n,), weight.double(), 1e-5)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not take"):
        built.rms_norm(x.bfloat16(), weight, 1e-5)
    with pytest.raises(ValueError, match="does not take"):
        built.rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(ValueError, match="does not take"):
        built.rms_norm(torch.randn(rows, 2 * n)[:, ::2], weight, 1e-5)  # rows apart


def test_top_k_finds_torchs_largest(built: kernels.Kernels) -> None:
    """The same sets as torch's ``topk`` (in no order): rows of logits' size, the largest at the
    ends and in the first k, rows shorter than a vector, and equal values (any of them)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(4, 49_157, generator=generator)
    x[1, -16:] += 10  # the largest at the end, past the last full vector
    x[2, :16] += 10  # the largest among the first k
    x[3] = torch.arange(49_157.0).flip(0)  # falling: every later one below the kept
    for k in (1, 16, 64):
        got = built.top_k(x, k)
        assert got.dtype == torch.int64 and got.shape == (4, k)
        assert torch.equal(got.sort(-1).values, x.topk(k, sorted=False).indices.sort(-1).values)
    short = torch.randn(3, 20, generator=generator)
    assert torch.equal(built.top_k(short, 16).sort(-1).values, short.topk(16).indices.sort(-1).values)
    ties = torch.zeros(1, 40)
    ties[0, [5, 30]] = 1.0
    chosen = built.top_k(ties, 4)[0].tolist()
    assert {5, 30} <= set(chosen) and len(set(chosen)) == 4  # and two of the equal zeros
    for bad in (0, 21, kernels.MAX_TOP + 1):
        with pytest.raises(ValueError, match="does not take"):
            built.top_k(short if bad == 21 else x, bad)
    with pytest.raises(ValueError, match="does not take"):
        built.top_k(x.double(), 16)


def test_silu_mul_is_torchs(built: kernels.Kernels) -> None:
    """The MLP's activation of a fused product ``[rows, 2 n]`` (gate, then up), gates far below and
    above zero included."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2 * 100, generator=generator) * 4
    x[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])
    gate, up = x.double().chunk(2, dim=-1)
    expected = functional.silu(gate) * up
    got = built.silu_mul(x)
    assert got.dtype == torch.float32 and got.shape == (3, 100) and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not take"):
        built.silu_mul(x.bfloat16())
    with pytest.raises(ValueError, match="does not take"):
        built.silu_mul(x[:, :-1])  # no even split
    with pytest.raises(ValueError, match="does not take"):
        built.silu_mul(torch.randn(3, 400)[:, ::2])  # rows apart


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_rope_store_rotates_and_writes_the_cache_as_torch_does(built: kernels.Kernels, dtype: torch.dtype) -> None:
    """``layers.rotate`` and the decoder's cache writes (``keys[slots, :, positions] = k``), against
    torch: two decoding rows and a chunk of three tokens of slot 2."""
    heads, kv, d, positions = 6, 2, 32, 40
    generator = torch.Generator().manual_seed(d)
    qkv = torch.randn(5, (heads + 2 * kv) * d, generator=generator)
    angles = torch.rand(positions, d // 2, generator=generator) * 6
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    rows = np.asarray([7, 39, 0, 1, 2]), np.asarray([0, 1, 2, 2, 2])
    keys, values = torch.zeros(3, kv, positions, d, dtype=dtype), torch.zeros(3, kv, positions, d, dtype=dtype)
    q = built.rope_store(qkv, heads, (cos, sin), rows, keys, values)
    at = torch.from_numpy(rows[0])
    turned = rotate(qkv[:, :(heads + kv) * d].unflatten(-1, (heads + kv, d)), cos[at][:, None], sin[at][:, None])
    expected_keys, expected_values = torch.zeros_like(keys), torch.zeros_like(values)
    expected_keys[rows[1], :, rows[0]] = turned[:, heads:].to(dtype)
    expected_values[rows[1], :, rows[0]] = qkv[:, (heads + kv) * d:].unflatten(-1, (kv, d)).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else tolerance_of(dtype)  # rounded once, from float32
    assert q.dtype == dtype and q.shape == (5, heads, d)
    torch.testing.assert_close(q.float(), turned[:, :heads], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(keys.float(), expected_keys.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(values, expected_values)
    if dtype == torch.float16:  # beyond float16's range: its largest value, not an infinity
        qkv[0, -d:] = torch.linspace(-1e6, 1e6, d)
        built.rope_store(qkv, heads, (cos, sin), rows, keys, values)
        assert values.isfinite().all() and values[0, -1, 7].abs().max() == torch.finfo(torch.float16).max
    with pytest.raises(ValueError, match="outside"):
        built.rope_store(qkv, heads, (cos, sin), (np.asarray([7, 40, 0, 1, 2]), rows[1]), keys, values)
    with pytest.raises(ValueError, match="does not take"):
        built.rope_store(qkv.bfloat16(), heads, (cos, sin), rows, keys, values)
    with pytest.raises(ValueError, match="does not take"):
        built.rope_store(qkv, heads + 1, (cos, sin), rows, keys, values)


def test_shapes_beyond_the_kernel_are_left_to_torch(built: kernels.Kernels) -> None:
    assert attention.decode_attention(built, attention.MAX_GROUP + 1, 64, 16) is None
    assert attention.decode_attention(built, 2, attention.MAX_DIM * 2, 16) is None
    assert attention.decode_attention(None, 2, 64, 16) is None
    kernel = attention.decode_attention(built, 2, 64, 16)
    assert kernel is not None
    keys = torch.zeros(1, 1, 16, 64)
    assert not kernel.supports(torch.zeros(1, 2, 64, dtype=torch.float64), keys.double())  # a dtype it lacks
    assert not kernel.supports(torch.zeros(1, 2, 64), keys.bfloat16())  # queries and keys differ
    assert not kernel.supports(torch.zeros(1, 3, 64), keys)  # not its group
    assert not kernel.supports(torch.zeros(1, 2, 64), torch.zeros(1, 1, 17, 64))  # more positions than its scratch
    one = np.asarray([0])
    with pytest.raises(ValueError, match="does not take"):
        kernel(torch.zeros(1, 2, 64), keys, torch.zeros(1, 1, 8, 64), one, np.asarray([3]))
    with pytest.raises(ValueError, match="does not take"):
        kernel(torch.zeros(1, 2, 64), keys, keys, np.asarray([1]), np.asarray([3]))  # no such slot
    with pytest.raises(ValueError, match="refused"):
        kernel(torch.zeros(1, 2, 64), keys, keys, one, np.asarray([16]))  # past the slot's positions


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 1000, 576), (3, 70, 96), (2, 33, 64), (6, 9, 96), (7, 5, 64),
                                             (5, 4, 96)])
def test_the_8_bit_product_is_the_product_of_the_quantised_inputs(built: kernels.Kernels, rows: int, n: int,
                                                                    k: int) -> None:
    """Exactly (to float32 sums) the product of the codes with the inputs quantised to 8 bits per
    32, as llama.cpp's Q8_0; within that quantisation of the float64 product. Odd group counts too."""
    generator = torch.Generator().manual_seed(k)
    weights = torch.randn(n, k, generator=generator) * 0.05
    codes, scales = Groups8.of(weights).codes()
    x = torch.randn(rows, k, generator=generator)
    got = built.int8_weights(codes, scales)(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    groups = x.view(rows, k // 32, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    quantised = (torch.round(groups / step) * step).view(rows, k)
    exact_codes = (codes.view(n, k // 32, 32).double() * scales[..., None].double()).view(n, k)
    torch.testing.assert_close(got.double(), quantised.double() @ exact_codes.T, rtol=1e-4, atol=1e-4)
    full = x.double() @ exact_codes.T
    assert (got.double() - full).abs().max() < 0.02 * full.abs().max()


def test_the_8_bit_product_refuses_what_it_cannot_take(built: kernels.Kernels) -> None:
    codes, scales = Groups8.of(torch.randn(8, 64)).codes()
    with pytest.raises(ValueError, match="inputs of 48"):
        built.int8_weights(codes, scales)(torch.zeros(1, 48))  # not the weights' inputs
    with pytest.raises(ValueError, match="8-bit groups"):
        built.int8_weights(codes.float(), scales)
    with pytest.raises(ValueError, match="float16's values"):
        built.int8_weights(codes, scales + 1e-6)  # the product reads them in float16: this would round


# rows: 4 at a time, then 3 or 2 together, or 1; groups: 18 (8 at a time, then 2), 9 (one alone)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 1000, 576), (4, 70, 1536), (2, 33, 96), (1, 5, 32), (9, 7, 96),
                                             (5, 40, 576), (4, 9, 288), (7, 12, 288), (6, 5, 576), (3, 8, 64)])
def test_the_4_bit_product_is_the_product_of_the_quantised_inputs(built: kernels.Kernels, rows: int, n: int,
                                                                    k: int) -> None:
    """Weights on Q4_1's grid (a code 0..15 times a scale plus a minimum per 32) against inputs
    quantised to 8 bits per 32: exactly their product (to float32 sums), odd group counts too."""
    generator = torch.Generator().manual_seed(k + rows)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=generator).float()
    scale = (torch.rand(n, k // 32, 1, generator=generator) * 0.01 + 1e-3).half().float()  # Q4_1's float16
    low = (-torch.rand(n, k // 32, 1, generator=generator) * 0.08).half().float()
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # each group's range is all 15 steps, as Q4_1 quantises
    weights = (codes * scale + low).view(n, k)
    packed, scales, minimums = Groups4.of(weights).for_kernels_c()
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert scales.shape == minimums.shape == (n, k // 32) and scales.dtype == minimums.dtype == torch.float16
    assert torch.equal(scales.float(), scale.view(n, -1)) and torch.equal(minimums.float(), low.view(n, -1))
    x = torch.randn(rows, k, generator=generator)
    got = built.int4_weights(weights)(x)
    groups = x.view(rows, k // 32, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    quantised = (torch.round(groups / step) * step).view(rows, k)
    torch.testing.assert_close(got.double(), quantised.double() @ weights.double().T, rtol=1e-4, atol=1e-4)
    full = x.double() @ weights.double().T
    assert (got.double() - full).abs().max() < 0.02 * full.abs().max()


def test_grouped_weights_hold_their_scales_as_float16_does() -> None:
    """Q4_1 holds a group's scale and minimum in float16, and so do the 4-bit groups of any weight:
    float16's values (what kernels.c reads), each weight within half a step of its code, and finite
    where a group is constant (its scale float16's smallest step) or past float16's range. The same
    for the 8-bit groups' scales (Q8_0's)."""
    weight = torch.randn(6, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    weight[0, :32] = 0.123456789  # constant
    weight[1, 32:64] = 1e6  # past float16's range
    groups = Groups4.of(weight)
    assert torch.equal(groups.scale.half().float(), groups.scale) and torch.equal(groups.low.half().float(), groups.low)
    restored = (groups.codes * groups.scale[..., None] + groups.low[..., None]).view(weight.shape)
    assert torch.isfinite(restored).all() and groups.scale.min() > 0
    usual = torch.ones_like(weight, dtype=torch.bool)
    usual[1, 32:64] = False
    error = (restored - weight).abs().view(6, 3, 32).amax(-1)[usual.view(6, 3, 32).all(-1)]
    steps = groups.scale[usual.view(6, 3, 32).all(-1)]
    assert (error <= steps * 0.51 + 1e-4).all()  # half a step; a constant group within float16's rounding
    eight = Groups8.of(weight)  # Q8_0 holds its scales in float16 too
    assert torch.equal(eight.scale.half().float(), eight.scale) and eight.scale.min() > 0
    assert torch.isfinite(eight.values * eight.scale[..., None]).all()


@pytest.mark.parametrize("block", [8, 16])
def test_the_blocks_hold_each_code_where_the_products_read_it(block: int) -> None:
    """kernels.c's blocks (8 rows on AVX2, 16 on AVX512-VNNI): byte ``4 r + t`` of a group's step ``s``
    is row ``r``'s code ``4 s + t`` (8-bit) or holds codes ``8 s + t`` and ``8 s + 4 + t`` (4-bit, low
    and high nibble); scales ``[blocks, groups, block]``; the rows padded with zeros to a multiple of
    the block. Checked for both sizes on any CPU: the products above read one of them, or none."""
    rows, groups = 19, 3
    blocks, step = -(-rows // block), 4 * block
    codes = torch.arange(rows * groups * 32).view(rows, groups, 32) % 251 - 125
    eight = in_blocks(codes.to(torch.int8), block, 4).flatten(1)
    assert eight.shape == (blocks, groups * 8 * step)
    for r, g, c in [(0, 0, 0), (3, 1, 17), (10, 2, 31), (7, 2, 5), (18, 1, 9)]:
        b, row = divmod(r, block)
        assert eight[b, (g * 8 + c // 4) * step + 4 * row + c % 4] == codes[r, g, c]
    assert not eight[-1].view(groups, 8, block, 4)[:, :, rows % block:].any()  # padding
    nibbles = torch.randint(0, 16, (rows, groups, 32), generator=torch.Generator().manual_seed(3))
    scale, low = torch.rand(rows, groups), -torch.rand(rows, groups)
    four, scales, lows = Groups4(nibbles.float(), scale, low).for_kernels_c(block)
    assert four.shape == (blocks, groups * 4 * step) and four.dtype == torch.uint8
    for r, g, c in [(0, 0, 0), (3, 1, 17), (10, 2, 31), (9, 0, 12), (18, 2, 30)]:
        b, row = divmod(r, block)
        byte = int(four[b, (g * 4 + c // 8) * step + 4 * row + c % 4])
        assert (byte >> 4 if c % 8 >= 4 else byte & 0x0F) == nibbles[r, g, c]
    first = (blocks - 1) * block
    assert scales.dtype == lows.dtype == torch.float16  # as Q4_1 holds them
    assert torch.equal(scales[-1, 2, :rows - first], scale[first:, 2].half()) and not scales[-1, :, rows - first:].any()
    assert torch.equal(lows, scales_in_blocks(low.half(), block)) and lows.shape == (blocks, groups, block)


def _cpu_has(flag: str) -> bool:
    return flag in Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else False


@pytest.mark.skipif(not _cpu_has("avx2") or not _cpu_has("fma"), reason="builds for an x86-64 CPU with AVX2")
@pytest.mark.parametrize(("march", "block"), [("haswell", 8), ("x86-64", 0)])
def test_the_products_built_for_other_cpus_give_this_hosts_results(built: kernels.Kernels, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, march: str,
                                                                   block: int) -> None:
    """Each CPU class's products (AVX512-VNNI's blocks of 16, AVX2's of 8, plain C's rows), whichever
    this host builds natively: built again here for an older CPU through a compiler that takes
    ``-march={march}`` for ``-march=native``, they agree with this host's (which agree with the
    reference above) on the shapes that exercise partial blocks, row counts and odd groups."""
    other = built_for(march, tmp_path, monkeypatch)
    assert other is not None and other.product_block == block and other.int8_vectorised == bool(block)
    generator = torch.Generator().manual_seed(5)
    for rows, n, k in [(1, 37, 576), (5, 19, 96), (4, 8, 288)]:
        weight = torch.randn(n, k, generator=generator) * 0.05
        x = torch.randn(rows, k, generator=generator)
        codes, scales = Groups8.of(weight).codes()
        for theirs, ours in [(other.int8_weights(codes, scales), built.int8_weights(codes, scales)),
                             (other.int4_weights(weight), built.int4_weights(weight))]:
            torch.testing.assert_close(theirs(x), ours(x), rtol=1e-5, atol=1e-5)


def test_they_are_built_once_per_host_and_kept(tmp_path: Path) -> None:
    assert kernels.load(tmp_path) is not None
    built = list(tmp_path.glob("kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert kernels.load(tmp_path) is not None
    assert built[0].stat().st_mtime_ns == stamp and list(tmp_path.glob("*.so")) == built


def test_loading_them_leaves_subnormal_floats_alone(built: kernels.Kernels) -> None:
    """Built with -ffast-math but not linked with it: gcc's start-up code for that would flush
    subnormal floats to zero in the thread that loads the library (the model's, or pytest's)."""
    tiny = np.float64(5e-324)
    assert tiny * np.float64(1.0) > 0 and np.float32(1e-45) * np.float32(1.0) > 0


def test_without_a_compiler_the_step_runs_on_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="workers.model.cpu.kernels"):
        assert kernels.load(tmp_path) is None
    assert "no C compiler" in caplog.text
    assert not list(tmp_path.glob("*.so"))


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo broken 1.0 && exit 0\necho no >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with caplog.at_level(logging.WARNING, logger="workers.model.cpu.kernels"):
        assert kernels.load(tmp_path / "kernels") is None
    assert "did not build" in caplog.text
    assert [path.name for path in (tmp_path / "kernels").iterdir()] == ["kernels.lock"]  # no library, no scraps


def test_workers_starting_together_build_once(tmp_path: Path) -> None:
    """Three processes load the kernels into an empty directory at once: one compiles, the others wait
    for its library."""
    compiler, log = tmp_path / "logged-cc", tmp_path / "compiles"
    compiler.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo "$$" >> {log}\nexec cc "$@"\n')
    compiler.chmod(0o755)
    load = "import sys; from pathlib import Path; from workers.model.cpu import kernels; " \
           "print(kernels.compiled(kernels.SOURCE, Path(sys.argv[1])))"
    env = {**os.environ, "CC": str(compiler)}
    processes = [subprocess.Popen([sys.executable, "-c", load, str(tmp_path / "built")], env=env, text=True,
                                  stdout=subprocess.PIPE) for _ in range(3)]
    paths = {process.communicate(timeout=300)[0].strip() for process in processes}
    assert all(process.returncode == 0 for process in processes)
    assert len(paths) == 1 and Path(paths.pop()).exists()
    assert len(log.read_text().split()) == 2  # one process compiled, then linked: no other called the compiler
