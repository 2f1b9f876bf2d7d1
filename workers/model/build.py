"""A loaded model made ready for the engine: the slot decoder where the architecture allows (its
kernels, 4-bit weights and prepacked layouts chosen for this host), else transformers' own forward
pass on slots."""

import logging

import torch

from workers.model.cpu import kernels
from workers.model.decoder import Decoder, unsupported_reason
from workers.model.fallback import HfSlots
from workers.model.linear import can_prepack
from workers.model.loader import LoadedModel
from workers.model.plan import SlotModel

logger = logging.getLogger(__name__)


def slot_model(loaded: LoadedModel, compile: bool) -> SlotModel:
    """The fast slot decoder where the architecture allows, else transformers' own forward pass."""
    spec = loaded.spec
    reason = unsupported_reason(loaded.model)
    if reason is None:
        built = kernels.load(loaded.kernel_dir) if loaded.device.type == "cpu" and loaded.kernel_dir is not None \
            else None
        decoder = Decoder(loaded.model, spec.max_batch_size, spec.context_window, compile=compile,
                          cache_dtype=cache_dtype(loaded, built, compile))
        if built is not None:  # before packing: it packs for them too
            decoder.use_kernels(built)
        if loaded.blocks is not None:
            decoder.use_blocks(loaded.blocks.built, loaded.blocks.matrices)
            logger.info("model %s: every product on %s", spec.id, decoder.output.packing)
        if loaded.exact_weights:
            packed = decoder.pack_int4(loaded.exact_weights, loaded.int4_rows, lossless_only=spec.weights == "auto",
                                       merge_rows=loaded.merge_rows)
            logger.info("model %s: decoding on %s weights, the output layer on %s", spec.id,
                        "4-bit" if packed else "dense", decoder.output.packing)
            loaded.exact_weights.clear()
        if loaded.device.type == "cpu" and can_prepack(loaded.dtype) and loaded.blocks is None:
            decoder.prepack()
        logger.info("model %s: %s weights, keys and values in %s", spec.id, str(loaded.dtype).removeprefix("torch."),
                    str(decoder.cache.layer(0)[0].dtype).removeprefix("torch."))
        return decoder
    logger.warning("model %s: the slot decoder does not support %s; running transformers' forward pass "
                   "one sequence at a time (slower)", spec.id, reason)
    return HfSlots(loaded.model, spec.max_batch_size, loaded.device)


def cache_dtype(loaded: LoadedModel, built: kernels.Kernels | None, compile: bool) -> torch.dtype:
    """The KV cache's dtype (``ModelSpec.kv_dtype``). ``auto``: float16 where a float32 model's eager
    step attends through ``kernels.c`` and the CPU converts float16 itself (F16C): a long row reads
    half the bytes of keys and values (docs/performance.md, "KV slots and the cache's dtype");
    elsewhere the model's dtype."""
    wanted = loaded.spec.kv_dtype
    if wanted != "auto":
        return getattr(torch, wanted)  # type: ignore[no-any-return]
    if built is not None and built.f16_fast and loaded.dtype == torch.float32 and not compile \
            and kernels.runs_here("attend"):
        return torch.float16
    return loaded.dtype
