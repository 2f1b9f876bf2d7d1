"""A GGUF file served in its own blocks: mapped, never de-quantised into a copy; and a float16 or
bfloat16 safetensors directory served the same way (``directory``).

The file is memory-mapped (as llama.cpp maps it): each weight the decoder multiplies stays a view of
its blocks in the file (``workers.model.cpu.blocks``), so a worker holds the file's pages, not a float32
model, and nothing is written to the model cache but the tokenizer and the config. The transformers
model the decoder takes over is built on the meta device (shapes only); its norms and biases, small,
are read in float32. Llama's queries and keys are stored with their halves interleaved (llama.cpp's
rotation); their rows are put back in transformers' order, the one copy made.

A tensor in a type the products do not take (Q2_K, Q3_K, the IQ types, ...) is de-quantised to float32
and multiplied as such, named once in the log. An architecture the slot decoder does not run, a
tensor type that cannot be read at all, or a truncated file is a ``ModelFileError``.
"""

import functools
import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lmsp_core.requests.modelfiles import gguf_tensors
from workers.model.cpu import blocks
from workers.model.cpu.blocks import BlockTensor

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # as the slot decoder runs them
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class ModelFileError(ValueError):
    """A model file the engine cannot serve: what, in one line."""


@dataclass
class GgufWeights:
    """A model's matrices by transformers' parameter name, as blocks (``BlockTensor``) mapped from its
    files: a GGUF file's, or a float16 or bfloat16 safetensors directory's (``directory``)."""

    matrices: dict[str, BlockTensor]
    file_bytes: int
    built: blocks.Blocks  # the products that take them


def reader(path: Path) -> Any:
    """gguf-py's reader of ``path`` (memory-mapped; parsed once per file as it is now: parsing a large
    vocabulary takes seconds); a ``ModelFileError`` for a file it cannot read."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelFileError(f"{path}: {exc.strerror}") from None
    return _reader(str(path.absolute()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:  # a truncated or foreign file
        raise ModelFileError(f"{Path(path).name} is not a readable GGUF file ({exc})") from None


def architecture(read: Any) -> str:
    field = read.fields.get("general.architecture")
    if field is None:
        raise ModelFileError("the GGUF file names no architecture (general.architecture)")
    return bytes(field.parts[field.data[0]]).decode()


def served_natively(path: Path) -> bool:
    """Whether a GGUF model runs on its own blocks rather than on a converted copy: every architecture
    the decoder runs, unless all of its layers' matrices are Q4_1 (those repack into ``kernels.c``'s
    groups without loss, whose one-call step is faster on a small model: docs/performance.md, "GGUF
    weights in their own blocks")."""
    try:
        fields, tensors = gguf_tensors(path)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path.name} is not a readable GGUF file ({exc})") from None
    if fields.get("general.architecture") not in ARCHITECTURES:
        return False
    layers = [t.kind for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2]
    return not layers or any(kind != blocks.Q4_1 for kind in layers)


def metadata(path: Path, target: Path) -> Path:
    """The tokenizer and config of the GGUF model at ``path``, written once (atomically) into
    ``target``; the weights stay in the file."""
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    logger.info("reading the tokenizer and config of %s into %s (first start only)", path.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        _head_dim(config, reader(path))
    except (ValueError, KeyError, OSError) as exc:
        raise ModelFileError(f"{path.name}: no tokenizer or config transformers can read ({exc})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".metadata-", dir=target.parent))
    try:
        tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)  # an older, partial copy
        os.replace(staging, target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _head_dim(config: Any, read: Any) -> None:
    """The heads' size where the file says it (transformers reads it for no architecture but takes
    Qwen3's default where a file omits it)."""
    field = read.fields.get(f"{architecture(read)}.attention.key_length")
    if field is not None:
        config.head_dim = int(field.parts[field.data[0]][0])


def skeleton(config: Any) -> Any:
    """The transformers model of ``config`` with its parameters on the meta device (no memory), its
    rotary embedding's frequencies computed on the CPU."""
    if config.model_type not in ARCHITECTURES:
        raise ModelFileError(f"architecture {config.model_type!r}: the engine serves GGUF files of "
                             f"{', '.join(ARCHITECTURES)}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def load(path: Path, model: Any, built: blocks.Blocks) -> GgufWeights:
    """The weights of the GGUF file at ``path`` for ``model`` (``skeleton``): its small tensors (norms,
    biases) read into the model in float32, its matrices as blocks mapped from the file."""
    read = reader(path)
    config = model.config
    names = {name: t for t in read.tensors if (name := _hf_name(t.name)) is not None}
    parameters = dict(model.named_parameters())
    missing = sorted(set(parameters) - set(names) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise ModelFileError(f"{path.name} lacks {len(missing)} tensors the model needs ({', '.join(missing[:3])}...)")
    matrices, dense = {}, set()
    for name, tensor in names.items():
        if name not in parameters:
            continue
        if len(tensor.shape) == 2:
            matrices[name], converted = _matrix(path, tensor, name, config)
            if converted:
                dense.add(tensor.tensor_type.name)
        else:
            values = torch.from_numpy(_float32(tensor).copy()).reshape(parameters[name].shape)
            _set(model, name, values)
    if dense:
        logger.warning("%s: tensors of %s have no product on their blocks here: de-quantised to float32",
                       path.name, ", ".join(sorted(dense)))
    return GgufWeights(matrices, path.stat().st_size, built)


_SAFETENSORS = {"BF16": blocks.BF16, "F16": blocks.F16, "F32": blocks.F32}


def directory(path: Path, model: Any, built: blocks.Blocks) -> GgufWeights:
    """The weights of a safetensors model directory for ``model`` (``skeleton``), as ``load`` reads a
    GGUF file's: each file mapped, its matrices views of it, its vectors read in float32."""
    parameters = dict(model.named_parameters())
    matrices, vectors, size = {}, set(), 0
    for file in sorted(path.glob("*.safetensors")):
        size += file.stat().st_size
        for name, (kind, shape, data) in _safetensors(file).items():
            if name not in parameters:
                continue
            if len(shape) == 2:
                matrices[name] = BlockTensor(data.reshape(shape[0], -1), kind, shape[0], shape[1])
            else:
                values = np.frombuffer(data.tobytes(), dtype={blocks.F16: np.float16, blocks.F32: np.float32}.get(
                    kind, np.uint16))
                floats = (values.astype(np.uint32) << 16).view(np.float32) if kind == blocks.BF16 else values
                _set(model, name, torch.from_numpy(floats.astype(np.float32)).reshape(parameters[name].shape))
                vectors.add(name)
    missing = sorted(set(parameters) - set(matrices) - vectors
                     - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()))
    if missing:
        raise ModelFileError(f"{path.name} lacks {len(missing)} tensors the model needs ({', '.join(missing[:3])}...)")
    return GgufWeights(matrices, size, built)


def _safetensors(file: Path) -> dict[str, tuple[int, list[int], np.ndarray]]:
    """A safetensors file's tensors of float16, bfloat16 or float32: their type (GGML's number), shape
    and bytes, a view of the mapped file."""
    with file.open("rb") as opened:
        length = int.from_bytes(opened.read(8), "little")
        header = json.loads(opened.read(length))
    mapped = np.memmap(file, dtype=np.uint8, mode="r")
    found = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _SAFETENSORS:
            raise ModelFileError(f"{file.name}: tensor {name} is {entry['dtype']}, not float16, bfloat16 or float32")
        start, end = entry["data_offsets"]
        found[name] = (_SAFETENSORS[entry["dtype"]], entry["shape"], mapped[8 + length + start:8 + length + end])
    return found


def _hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _LAYER.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
    hf = _TOP.get(base)
    return None if hf is None else f"{hf}.{suffix}"


def _matrix(path: Path, tensor: Any, name: str, config: Any) -> tuple[BlockTensor, bool]:
    """A matrix as blocks: a view of the mapped file, or (Llama's queries and keys) its rows in
    transformers' order, or (a type without a product) float32. Whether it was de-quantised."""
    cols, rows = (int(n) for n in tensor.shape)
    kind = int(tensor.tensor_type)
    if kind not in blocks.BLOCK_BYTES:
        values = _float32(tensor).reshape(rows, cols)
        return BlockTensor(values.view(np.uint8).reshape(rows, -1), blocks.F32, rows, cols), True
    data = _bytes(path, tensor, rows)
    if config.model_type in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if name.endswith("q_proj.weight") else config.num_key_value_heads
        data = np.ascontiguousarray(data[_unpermuted(rows, heads)])
    return BlockTensor(data, kind, rows, cols), False


def _bytes(path: Path, tensor: Any, rows: int) -> np.ndarray:
    data: np.ndarray = tensor.data
    if data.dtype != np.uint8:  # F32, F16 and BF16 tensors come typed
        data = data.view(np.uint8)
    if data.size != int(tensor.n_bytes):
        raise ModelFileError(f"{path.name} ends inside tensor {tensor.name} (a truncated file)")
    return data.reshape(rows, -1)


def _unpermuted(rows: int, heads: int) -> np.ndarray:
    """The file's row of each of transformers' rows of Llama's queries or keys: a head's rows are
    stored with its two halves interleaved (``convert_hf_to_gguf.py``'s permute)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(-1)


def _float32(tensor: Any) -> np.ndarray:
    import gguf

    try:
        values: np.ndarray = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except (NotImplementedError, ValueError) as exc:
        raise ModelFileError(f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be read ({exc})") from None
    return values


def _set(model: Any, name: str, values: torch.Tensor) -> None:
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attribute, torch.nn.Parameter(values.float(), requires_grad=False))
