"""One transformer layer of the slot decoder (``workers.model.decoder``) and its arithmetic: the RMS
norm of the float32 residual, the rotation of queries and keys, the fused projections, the MLP's
activation."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from workers.model.linear import Linear, frozen


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """As transformers computes it: in float32, scaled in the model's dtype."""
    if x.dtype == weight.dtype == torch.float32:  # one operator instead of seven, the same arithmetic
        return functional.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


NativeNorm = Callable[[Tensor, Tensor, float], Tensor]  # ``kernels.Kernels.rms_norm``
NativeActivation = Callable[[Tensor], Tensor]  # ``kernels.Kernels.silu_mul``


def norm(x: Tensor, weight: Tensor, eps: float, native: NativeNorm | None) -> Tensor:
    """``rms_norm``, through ``native`` (``kernels.c``) where it takes the rows: float32 rows and
    weights, an eager step (a compiled one keeps torch's operator). torch's on a CPU is seven
    operators, twice a layer (docs/performance.md, "CPU kernels")."""
    if native is not None and x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() \
            and not torch.compiler.is_compiling():
        return native(x, weight, eps)
    return rms_norm(x, weight, eps)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, with ``rotate_half``'s negation moved into
    the table (``signed_sin``: the first half's sines negated): two fewer operators."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rope_tables(rotary: Any, positions: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin of every position, computed as transformers' rotary embedding does; the sines of
    the first half negated (``rotate``)."""
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    freqs = torch.arange(positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    scale = getattr(rotary, "attention_scaling", 1.0)
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return (angles.cos() * scale).to(dtype), (signed_sin * scale).to(dtype)


def _fused(*linears: Any) -> Linear:
    """One product for several of the model's linear layers, whose weights then become views of the
    fused one: the model still works, and its weights are not held twice."""
    fused = Linear(torch.cat([linear.weight for linear in linears]),
                   None if linears[0].bias is None else torch.cat([linear.bias for linear in linears]))
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = frozen(fused.weight[start:start + rows])
        if fused.bias is not None:
            linear.bias = frozen(fused.bias[start:start + rows])
        start += rows
    return fused


class Layer(nn.Module):
    def __init__(self, hf_layer: Any, eps: float) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.eps = eps
        # norms of the float32 residual in float32 whatever the weights' dtype: one fused operator,
        # rounded once (by the product that takes them) instead of twice
        self.input_norm = frozen(hf_layer.input_layernorm.weight.float())
        self.post_norm = frozen(hf_layer.post_attention_layernorm.weight.float())
        self.qkv = _fused(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = None if q_norm is None else frozen(q_norm.weight)
        self.k_norm = None if k_norm is None else frozen(k_norm.weight)
        self.gate_up = _fused(mlp.gate_proj, mlp.up_proj)
        self.down = Linear(mlp.down_proj.weight)
        # kernels.c's, where the decoder uses them
        self.native_norm: NativeNorm | None = None
        self.native_activation: NativeActivation | None = None

    def project(self, x: Tensor, shape: tuple[int, int, int], cos: Tensor, sin: Tensor,
                decoding: int) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[N, heads, head_dim]``, keys and values ``[N, kv_heads, head_dim]``, rotated
        (``decoding``: how many of the first rows are decoding rows, ``Linear.forward``)."""
        heads, kv_heads, head_dim = shape
        qkv = self.qkv(norm(x, self.input_norm, self.eps, self.native_norm), decoding)
        qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
        qk, v = qk.unflatten(-1, (heads + kv_heads, head_dim)), v.unflatten(-1, (kv_heads, head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=1)
            return rotate(rms_norm(q, self.q_norm, self.eps), cos, sin), \
                rotate(rms_norm(k, self.k_norm, self.eps), cos, sin), v
        q, k = torch.split(rotate(qk, cos, sin), [heads, kv_heads], dim=1)  # queries and keys turn as one
        return q, k, v

    def project_stored(self, x: Tensor, decoding: int, store: Callable[[Tensor], Tensor]) -> Tensor:
        """``project`` with the rotation and the cache writes in ``store`` (``kernels.Kernels.rope_store``,
        which takes the float32 product): the queries, in the cache's dtype."""
        qkv = self.qkv(norm(x, self.input_norm, self.eps, self.native_norm), decoding, cast=False)
        return store(qkv.float().contiguous())

    def finish(self, x: Tensor, attended: Tensor, decoding: int) -> Tensor:
        """Output projection, residual, MLP, residual (the residual stream in float32)."""
        h = x + self.o(attended, decoding, cast=False)  # the sum in float32 whatever the product's dtype
        activated = self._activated(norm(h, self.post_norm, self.eps, self.native_norm), decoding)
        out: Tensor = h + self.down(activated, decoding, cast=False)
        return out

    def _activated(self, x: Tensor, decoding: int) -> Tensor:
        """``silu(gate) * up`` of the fused product: through ``native_activation`` (``kernels.c``, in
        float32) where the product is float32 rows (the 4-bit kernel's, or a float32 model's), else
        torch's in the weights' dtype."""
        if self.native_activation is None or torch.compiler.is_compiling():
            product = self.gate_up(x, decoding)
        else:
            product = self.gate_up(x, decoding, cast=False)
            if product.dtype == torch.float32 and product.dim() == 2 and product.is_contiguous():
                return self.native_activation(product)
            product = product.to(self.gate_up.weight.dtype)
        gate, up = product.chunk(2, dim=-1)
        activated: Tensor = functional.silu(gate) * up
        return activated
