"""Models named on the command line by path or Hugging Face name (``lmsp up --model PATH``), made
catalog specs from their own files.

A reference is a catalog id, a transformers model directory (config.json, a tokenizer, safetensors
weights), a GGUF file, or ``hf:ORG/NAME[@REVISION]``: a snapshot in huggingface_hub's cache, which
huggingface_hub downloads first unless ``HF_HUB_OFFLINE=1`` (``HF_TOKEN``, ``HF_HOME`` and
``HF_HUB_CACHE`` are its own). What the spec says comes from the model's files: its id is the
directory's name, the file's stem or ``ORG/NAME`` (as vLLM serves it, so clients written for that
name work unchanged); its context window config.json's ``max_position_embeddings`` or the GGUF's
``<architecture>.context_length``; a chat template that closes a ``<think>`` section, with both
markers single tokens of the vocabulary, makes it a reasoning model. Command-line flags
(``Overrides``) win over the files. The command line hands the specs to the API and the workers in
``Settings.model_specs``, so every process has the same catalog.
"""

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any, Literal

import jinja2
import msgspec
from tokenizers import Tokenizer

from lmsp_core import wire
from lmsp_core.requests.catalog import Catalog, ModelSpec, ReasoningFormat
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.requests.modelfiles import card_from_files, dir_chat_template, gguf_fields, gguf_tensors, is_gguf
from lmsp_core.settings import Settings

HF_PREFIX = "hf:"
# what a model directory needs of a Hugging Face repository: other weight formats (.bin, .pt, .gguf,
# ONNX) that many repositories carry beside safetensors are not downloaded
HUB_FILES = ["*.json", "*.jinja", "*.txt", "tokenizer.model", "*.safetensors"]
HUB_SKIPPED = ["consolidated*"]  # Mistral's single-file copy of the weights the shards hold
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# config.json's names for the context window, the usual one first
WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# every model given by path can do all of these: the service renders tools for a template that
# knows none, and constrained decoding keeps tool calls and structured output valid
CAPABILITIES: list[wire.Capability] = ["streaming", "tools", "structured_output", "conversations"]

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class ModelRefError(ValueError):
    """A reference that names no model, or flags that do not fit it; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What the command line says about its models, over what their files say (None: the files')."""

    id: str | None = None
    context_window: int | None = None
    max_batch_size: int | None = None
    dtype: Dtype | None = None
    chat_template: str | None = None  # the template itself

    def fields(self) -> dict[str, Any]:
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}


@dataclasses.dataclass(frozen=True)
class _Found:
    """What a model's files say."""

    where: str  # the path, for messages
    id: str
    source: str
    context_window: int | None
    chat_template: str | None


def resolve_all(references: list[str], catalog: Catalog, overrides: Overrides, cache_dir: Path,
                weights: bool = True) -> list[ModelSpec]:
    """The specs of ``references``; ``weights``: a directory must have them (a worker loads it; an API
    reads only the tokenizer, and downloads no weights for an ``hf:`` reference)."""
    if overrides.id is not None and len(references) > 1:
        raise ModelRefError(f"--model-id names one model, and {len(references)} were given")
    specs = [resolve(reference, catalog, overrides, cache_dir, weights) for reference in references]
    ids = [spec.id for spec in specs]
    twice = sorted({model_id for model_id in ids if ids.count(model_id) > 1})
    if twice:
        raise ModelRefError(f"two models would be served as {twice[0]!r}: serve them from separate commands, each "
                            "with --model-id")
    return specs


def resolve(reference: str, catalog: Catalog, overrides: Overrides, cache_dir: Path,
            weights: bool = True) -> ModelSpec:
    if reference in catalog:  # an id first: a catalog id that is also a relative path means the model
        return _spec(reference, msgspec.to_builtins(catalog.get(reference)), overrides)
    if reference.startswith(HF_PREFIX):
        name = reference.removeprefix(HF_PREFIX)
        snapshot = hub_snapshot(name, weights)
        return from_path(snapshot, overrides, cache_dir, weights, default_id=name.partition("@")[0])
    path = Path(os.path.abspath(os.path.expanduser(reference)))
    if not path.exists():
        raise ModelRefError(f"{reference}: no such file or directory, and no model of the catalog has this id "
                            f"(a Hugging Face model: {HF_PREFIX}ORG/NAME)")
    return from_path(path, overrides, cache_dir, weights)


def from_path(path: Path, overrides: Overrides, cache_dir: Path, weights: bool = True,
              default_id: str | None = None) -> ModelSpec:
    """The spec of a model directory or GGUF file."""
    found = _directory(path, weights) if path.is_dir() else _gguf(path, weights)
    template = overrides.chat_template or found.chat_template
    if template is None:
        raise ModelRefError(f"{found.where}: no chat template (a base model?); give one with --chat-template FILE")
    window = overrides.context_window or found.context_window
    if window is None:
        raise ModelRefError(f"{found.where}: its files give no context window; give one with --context-window N")
    fields = {"id": default_id or found.id, "source": found.source, "context_window": window,
              # as the built-in models: a request that names no output budget gets half the window at most
              "max_output_tokens": max(1, window // 2), "capabilities": CAPABILITIES}
    spec = _spec(found.where, fields, overrides)
    return msgspec.structs.replace(spec, reasoning=reasoning_of(spec, template, cache_dir))


def _spec(where: str, fields: dict[str, Any], overrides: Overrides) -> ModelSpec:
    """A spec of ``fields`` and the overrides, checked as a models file's would be."""
    fields = fields | overrides.fields()
    fields["max_output_tokens"] = min(fields["max_output_tokens"], fields["context_window"])
    try:
        return msgspec.convert(fields, ModelSpec)
    except msgspec.ValidationError as exc:
        raise ModelRefError(f"{where}: {exc}") from None


def _directory(path: Path, weights: bool) -> _Found:
    if not (path / "config.json").is_file():
        raise ModelRefError(f"{path}: a directory without config.json, so not a Hugging Face model directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelRefError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if weights and next(path.glob("*.safetensors"), None) is None:
        raise ModelRefError(f"{path}: no weights (*.safetensors)")
    try:
        config = json.loads((path / "config.json").read_text())
        template = dir_chat_template(path)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelRefError(f"{path}: unreadable model files ({exc})") from None
    return _Found(str(path), path.name, f"hf-dir:{path}", _window(config), template)


def _window(config: Any) -> int | None:
    """The context window config.json gives (a multimodal model's in its ``text_config``)."""
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config")):
        values = [section.get(key) for key in WINDOW_KEYS] if isinstance(section, dict) else []
        found = next((value for value in values if isinstance(value, int) and value > 0), None)
        if found is not None:
            return found
    return None


def _gguf(path: Path, weights: bool) -> _Found:
    if not is_gguf(path):
        raise ModelRefError(f"{path}: not a GGUF file (a model is a .gguf file or a Hugging Face model directory)")
    if weights:
        check_tensors(path)
    try:
        fields = gguf_fields(path, lambda key: key in ("general.architecture", "tokenizer.chat_template")
                             or key.endswith(".context_length"))
    except (OSError, ValueError, struct.error) as exc:  # struct.error: the header ends early
        raise ModelRefError(f"{path}: an unreadable GGUF file ({exc})") from None
    window = fields.get(f"{fields.get('general.architecture')}.context_length")
    return _Found(str(path), path.stem, f"gguf-file:{path}", window if isinstance(window, int) else None,
                  fields.get("tokenizer.chat_template"))


def check_tensors(path: Path) -> None:
    """That every tensor of a GGUF file is of a type GGML knows and lies whole within the file (a download
    cut short ends inside one); a ``ModelRefError`` naming the first that does not."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        _, tensors = gguf_tensors(path)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:  # the header ends early
        raise ModelRefError(f"{path}: an unreadable GGUF file ({exc})") from None
    size = path.stat().st_size
    known = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
    for name, tensor in tensors.items():
        if tensor.kind not in known:
            raise ModelRefError(f"{path}: tensor {name} has GGML type {tensor.kind}, which this version cannot read")
        block, block_bytes = known[tensor.kind]
        count = 1
        for dim in tensor.shape:
            count *= dim
        end = tensor.start + count // block * block_bytes
        if end > size:
            name_of = GGMLQuantizationType(tensor.kind).name
            raise ModelRefError(f"{path}: the file ends inside tensor {name} ({name_of}): a truncated file "
                                f"({size} of at least {end} bytes)")


def reasoning_of(spec: ModelSpec, chat_template: str, cache_dir: Path) -> ReasoningFormat | None:
    """The reasoning section of a model whose chat template closes one and whose vocabulary has both
    markers as tokens; opened by the template where its generation prompt ends inside one (as
    DeepSeek-R1's does), else by the model (as Qwen3's)."""
    markers = ReasoningFormat()
    if markers.end not in chat_template:
        return None
    card = card_from_files(spec, cache_dir)
    if card is None:
        return None
    vocabulary = Tokenizer.from_str(card.tokenizer_json)
    if vocabulary.token_to_id(markers.start) is None or vocabulary.token_to_id(markers.end) is None:
        return None
    hello = wire.Message(role="user", content=[wire.InputText(text="Hello")])
    try:
        opened = PromptRenderer(card).render([hello]).rstrip().endswith(markers.start)
    except jinja2.TemplateError:  # a template that wants more than one user message: the model's choice
        opened = False
    return ReasoningFormat(opened_by="template" if opened else "model")


def hub_snapshot(name: str, weights: bool = True) -> Path:
    """The local snapshot of ``ORG/NAME[@REVISION]`` in huggingface_hub's cache, downloaded first
    unless ``HF_HUB_OFFLINE=1``; without ``weights``, only its other files."""
    from huggingface_hub import snapshot_download  # only for hf: references

    repo, _, revision = name.partition("@")
    patterns = HUB_FILES if weights else [pattern for pattern in HUB_FILES if pattern != "*.safetensors"]
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=patterns,
                                      ignore_patterns=HUB_SKIPPED))
    except (OSError, ValueError) as exc:  # huggingface_hub's errors: not found, offline, not cached, bad name
        raise ModelRefError(f"{HF_PREFIX}{name}: {' '.join(str(exc).split()) or type(exc).__name__}") from None


def with_specs(settings: Settings, catalog: Catalog, specs: list[ModelSpec]) -> Settings:
    """``settings`` with ``specs`` added to their catalog (``catalog``, read from them), each replacing
    any of its id; a spec the catalog already has as it is adds nothing."""
    new = [spec for spec in specs if spec.id not in catalog or catalog.get(spec.id) != spec]
    if not new:
        return settings
    kept = msgspec.json.decode(settings.model_specs, type=list[ModelSpec]) if settings.model_specs else []
    merged = {spec.id: spec for spec in [*kept, *new]}
    return settings.replace(model_specs=msgspec.json.encode(list(merged.values())).decode())


def read_template(path: str | None) -> str | None:
    """A chat template file's text (``--chat-template FILE``)."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelRefError(f"--chat-template {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
