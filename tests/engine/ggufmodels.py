"""GGUF files of small models, written here: random blocks of any GGML type in the shape and layout of
a Llama, Qwen2 (biases on q, k and v) or Qwen3 (norms of q and k) model, and SmolLM2's tokenizer.

A K-quant cannot be made from floats without llama.cpp's quantiser, so every block is drawn at random
as bytes, its float16 scales drawn in a range that keeps the model's activations sensible: any bytes
are a valid block. transformers reads the same file de-quantised, the reference the tests hold the
engine's logits against. The tokenizer is SmolLM2's first ``VOCAB`` tokens."""

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from lmsp_core.requests.catalog import SMOLLM2
from lmsp_core.requests.modelfiles import gguf_file

Q = gguf.GGMLQuantizationType
# where a block's float16 scales are (byte offsets), per type
_SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
           Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


# types whose codes times their sub-blocks' scales reach far wider than the others': their scales are
# drawn this much smaller, so that every type's weights are of one size (a model of wide weights
# amplifies the inputs' rounding from layer to layer)
_WIDE = {Q.Q6_K: 8, Q.Q8_0: 4, Q.Q3_K: 4}


VOCAB = 2048  # of SmolLM2's tokens: its special ones, the bytes and the first merges


@dataclass(frozen=True)
class Shape:
    hidden: int = 256
    ffn: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 0  # 0: hidden / heads


def write(path: Path, architecture: str = "llama", matrices: Q = Q.Q4_K, embeddings: Q = Q.Q6_K,
          output: Q | None = None, shape: Shape = Shape(), seed: int = 0,
          types: dict[str, Q] | None = None) -> Path:
    """A model file at ``path``: its layers' matrices in ``matrices`` (``types``: by tensor name, e.g.
    ``{"attn_v": Q.Q6_K}``), the embeddings in ``embeddings``, and an output layer of its own in
    ``output`` (None: tied to the embeddings)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, architecture)
    vocab = _copy_tokenizer(writer)
    head_dim = shape.head_dim or shape.hidden // shape.heads
    for key, value in (("block_count", shape.layers), ("context_length", 2048), ("embedding_length", shape.hidden),
                       ("feed_forward_length", shape.ffn), ("attention.head_count", shape.heads),
                       ("attention.head_count_kv", shape.kv_heads)):
        writer.add_uint32(f"{architecture}.{key}", value)
    if shape.head_dim:
        writer.add_uint32(f"{architecture}.attention.key_length", head_dim)
        writer.add_uint32(f"{architecture}.attention.value_length", head_dim)
    writer.add_float32(f"{architecture}.rope.freq_base", 10000.0)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", _blocks(rng, embeddings, vocab, shape.hidden), raw_dtype=embeddings)
    if output is not None:
        writer.add_tensor("output.weight", _blocks(rng, output, vocab, shape.hidden), raw_dtype=output)
    writer.add_tensor("output_norm.weight", _norm(rng, shape.hidden))
    sizes = {"attn_q": (shape.heads * head_dim, shape.hidden), "attn_k": (shape.kv_heads * head_dim, shape.hidden),
             "attn_v": (shape.kv_heads * head_dim, shape.hidden), "attn_output": (shape.hidden, shape.heads * head_dim),
             "ffn_gate": (shape.ffn, shape.hidden), "ffn_up": (shape.ffn, shape.hidden),
             "ffn_down": (shape.hidden, shape.ffn)}
    for layer in range(shape.layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(f"{prefix}attn_norm.weight", _norm(rng, shape.hidden))
        writer.add_tensor(f"{prefix}ffn_norm.weight", _norm(rng, shape.hidden))
        for name, (rows, cols) in sizes.items():
            kind = (types or {}).get(name, matrices)
            writer.add_tensor(f"{prefix}{name}.weight", _blocks(rng, kind, rows, cols), raw_dtype=kind)
            if architecture == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"{prefix}{name}.bias", rng.normal(0, 0.5, rows).astype(np.float32))
        if architecture == "qwen3":
            writer.add_tensor(f"{prefix}attn_q_norm.weight", _norm(rng, head_dim))
            writer.add_tensor(f"{prefix}attn_k_norm.weight", _norm(rng, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(writer: gguf.GGUFWriter) -> int:
    """SmolLM2's tokenizer, its first ``VOCAB`` tokens and the merges among them (a file that every
    reader parses in a fraction of the time); returns the vocabulary's size."""
    fields = _tokenizer_fields()
    for name, (value, kind, sub_type) in fields.items():
        writer.add_key_value(name, value, kind, sub_type)
    return len(fields["tokenizer.ggml.tokens"][0])


@functools.cache
def _tokenizer_fields() -> dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    reader = gguf.GGUFReader(gguf_file(SMOLLM2))
    tokens: list[str] = reader.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    known = set(tokens)
    fields = {}
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:VOCAB]
        elif name == "tokenizer.ggml.merges":
            value = [merge for merge in value if all(part in known for part in merge.split(" ")) and
                     merge.replace(" ", "") in known]
        fields[name] = (value, field.types[0], field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    return fields


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1 + rng.normal(0, 0.1, n)).astype(np.float32)


def _blocks(rng: np.random.Generator, kind: Q, rows: int, cols: int) -> np.ndarray:
    """A ``rows`` x ``cols`` tensor of random blocks of ``kind`` as bytes (float types: values)."""
    if kind == Q.F32:
        return rng.normal(0, 0.02, (rows, cols)).astype(np.float32)
    if kind == Q.F16:
        return rng.normal(0, 0.02, (rows, cols)).astype(np.float16)
    if kind == Q.BF16:
        values = rng.normal(0, 0.02, (rows, cols)).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = []
    for offset in _SCALES[kind]:
        scale = rng.uniform(5e-5, 2.5e-4, data.shape[0]).astype(np.float16) / _WIDE.get(kind, 1)
        data[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        scales.append(scale)
    if kind in _MIDDLE:  # weights about zero: each block's minimum the middle code's weight
        middle = _MIDDLE[kind]
        low = (scales[0].astype(np.float32) * (-middle if kind in (Q.Q4_1, Q.Q5_1) else middle)).astype(np.float16)
        data[:, 2:4] = low.view(np.uint8).reshape(-1, 2)
        if kind in (Q.Q4_K, Q.Q5_K):
            data[:, 4:16] = _scales_as_minimums(rng, data.shape[0])
    return data.reshape(rows, cols // block * size)


# the middle code of the types with a minimum per block (codes 0..15 or 0..31)
_MIDDLE = {Q.Q4_1: 7.5, Q.Q5_1: 15.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5}


def _scales_as_minimums(rng: np.random.Generator, count: int) -> np.ndarray:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums, each sub-block's minimum its scale (with
    the block's minimum the middle code's weight: sub-blocks about zero)."""
    six = rng.integers(0, 64, (count, 8), dtype=np.uint8)
    packed = np.empty((count, 12), dtype=np.uint8)
    for j in range(4):
        high = (six[:, j + 4] >> 4) << 6
        packed[:, j] = six[:, j] | high
        packed[:, j + 4] = six[:, j] | high
        packed[:, j + 8] = (six[:, j + 4] & 0xF) | ((six[:, j + 4] & 0xF) << 4)
    return packed
