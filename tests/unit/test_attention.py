"""The decoding rows' attention kernel (workers/attend.c) against torch's, on the shapes it runs."""

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional

from workers import attention


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limits: list[int]) -> torch.Tensor:
    """torch's attention in float64 over each row's own slot, up to its limit (zeros below 0)."""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    out = torch.zeros(rows, heads, head_dim, dtype=torch.float64)
    for r, limit in enumerate(limits):
        if limit >= 0:
            out[r] = functional.scaled_dot_product_attention(
                q[r, :, None].double(), keys[r, :, :limit + 1].double(), values[r, :, :limit + 1].double(),
                enable_gqa=heads != kv_heads)[:, 0]
    return out.flatten(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128), (2, 2, 16), (4, 1, 32)])
def test_the_kernel_attends_as_torch_does(kernels: Path, dtype: torch.dtype, kv_heads: int, group: int,
                                          head_dim: int) -> None:
    positions, limits = 300, [299, 0, 136, -1]
    kernel = attention.load(kernels, group, head_dim, positions)
    assert kernel is not None
    generator = torch.Generator().manual_seed(head_dim)
    keys, values = (torch.randn(5, kv_heads, positions, head_dim, generator=generator).to(dtype) for _ in range(2))
    fused = torch.randn(len(limits), kv_heads * (group + 2), head_dim, generator=generator).to(dtype)
    q = fused[:, :kv_heads * group]  # a view, as the decoder's queries are (rows further apart)
    assert kernel.supports(q, keys)
    got = kernel(q, keys, values, np.asarray(limits))
    assert got.dtype == dtype and got.shape == (len(limits), kv_heads * group * head_dim)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: its rounding of the result
    torch.testing.assert_close(got.double(), reference(q, keys, values, limits), rtol=tolerance, atol=tolerance)
    assert not got[3].any()  # a row below 0 attends to nothing


def test_shapes_beyond_the_kernel_are_left_to_torch(kernels: Path) -> None:
    assert attention.load(kernels, attention.MAX_GROUP + 1, 64, 16) is None
    assert attention.load(kernels, 2, attention.MAX_DIM * 2, 16) is None
    kernel = attention.load(kernels, 2, 64, 16)
    assert kernel is not None
    keys = torch.zeros(1, 1, 16, 64)
    assert not kernel.supports(torch.zeros(1, 2, 64, dtype=torch.float16), keys.half())  # a dtype it lacks
    assert not kernel.supports(torch.zeros(1, 2, 64), keys.bfloat16())  # queries and keys differ
    assert not kernel.supports(torch.zeros(1, 3, 64), keys)  # not its group
    assert not kernel.supports(torch.zeros(1, 2, 64), torch.zeros(1, 1, 17, 64))  # more positions than its scratch
    with pytest.raises(ValueError, match="does not take"):
        kernel(torch.zeros(1, 2, 64), keys, torch.zeros(1, 1, 8, 64), np.asarray([3]))
    with pytest.raises(ValueError, match="refused"):
        kernel(torch.zeros(1, 2, 64), keys, keys, np.asarray([16]))  # past the slot's positions


def test_it_is_built_once_per_host_and_kept(tmp_path: Path) -> None:
    assert attention.load(tmp_path, 3, 64, 16) is not None
    built = list(tmp_path.glob("attend-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.so.tmp*"))
    stamp = built[0].stat().st_mtime_ns
    assert attention.load(tmp_path, 3, 64, 16) is not None
    assert built[0].stat().st_mtime_ns == stamp and list(tmp_path.glob("*.so")) == built


def test_without_a_compiler_decoding_attends_through_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="workers.attention"):
        assert attention.load(tmp_path, 3, 64, 16) is None
    assert "no C compiler" in caplog.text
    assert not list(tmp_path.glob("*.so"))
