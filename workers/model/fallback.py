"""Steps on KV slots for any transformers causal LM, through the model's own forward pass.

The fallback for architectures the slot decoder (``workers.model.decoder``) does not know: each slot
holds a transformers ``DynamicCache``, and every sequence of a step runs through the model on its
own. Correct for any model transformers can run, but without batching: the slot decoder is the
fast path.
"""

from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from workers.model.plan import StepPlan


class HfSlots:
    def __init__(self, model: Any, slots: int, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._slots = slots
        self._caches: dict[int, DynamicCache] = {}

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def vocab(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def release(self, slot: int) -> None:
        self._caches.pop(slot, None)

    @property
    def keeps_prefixes(self) -> bool:
        return False  # a released slot's cache is dropped

    @property
    def one_call_rows(self) -> int:
        return 0

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        raise NotImplementedError("transformers' caches are not kept after release")

    def run(self, plan: StepPlan, fed: Tensor | None = None) -> Tensor:
        tokens = [feed.token for feed in plan.feeds] if fed is None else fed.tolist()
        logits = [self._forward(feed.slot, [token], feed.position)
                  for feed, token in zip(plan.feeds, tokens, strict=True)]
        for chunk in plan.chunks:
            if chunk.start == 0:
                self._caches[chunk.slot] = DynamicCache(config=self.model.config)
            out = self._forward(chunk.slot, chunk.tokens, chunk.start)
            if chunk.last:
                logits.append(out)
        return torch.stack(logits) if logits else torch.empty((0, self.vocab), device=self.device)

    def _forward(self, slot: int, tokens: list[int], start: int) -> Tensor:
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, cache=self._caches[slot], use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1]  # type: ignore[no-any-return]
