"""The decoding batch: left-padded rows sharing one KV cache, which rows join and leave.

Rows are aligned on the right: every row's next token goes into the same new cache column.
A row that joins is prefilled on its own (with the others that join at the same step) and its
cache is left-padded to the batch's length before the two are concatenated; a row that leaves
is dropped by index, and cache columns that only padding uses any more are trimmed.
"""

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    if width == 0:
        return tensor
    pad = tensor.new_zeros((*tensor.shape[:-2], width, tensor.shape[-1]))
    return torch.cat([pad, tensor], dim=-2)


@dataclass
class Batch:
    cache: DynamicCache
    mask: torch.Tensor  # [rows, columns], 1 where a column holds a real token of the row
    positions: torch.Tensor  # [rows], position id of each row's next token
    last_tokens: torch.Tensor  # [rows], the token each row feeds at the next step

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), then drop columns no row uses."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.last_tokens = self.last_tokens.index_select(0, index)
        self._trim()

    def extend(self, other: "Batch") -> None:
        """Append the rows of ``other`` after ours, padding the shorter cache on the left."""
        width = max(self.width, other.width)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width - self.width),
                                   _pad_left(theirs.keys, width - other.width)])
            mine.values = torch.cat([_pad_left(mine.values, width - self.width),
                                     _pad_left(theirs.values, width - other.width)])
        self.mask = torch.cat([
            torch.nn.functional.pad(self.mask, (width - self.width, 0)),
            torch.nn.functional.pad(other.mask, (width - other.width, 0)),
        ])
        self.positions = torch.cat([self.positions, other.positions])
        self.last_tokens = torch.cat([self.last_tokens, other.last_tokens])

    def _trim(self) -> None:
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else self.width
        if start == 0:
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, start:]
            layer.values = layer.values[:, :, start:]
        self.mask = self.mask[:, start:]

    def decode_inputs(self) -> dict[str, Any]:
        """Model inputs for one decoding step; grows the mask by the new column."""
        ones = torch.ones((self.size, 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        return {
            "input_ids": self.last_tokens[:, None],
            "attention_mask": self.mask,
            "position_ids": self.positions[:, None],
            "cache": self.cache,
            "use_cache": True,
        }


def prefill(model: Any, prompts: list[list[int]], device: torch.device) -> tuple[Batch, torch.Tensor]:
    """Run the prompts through the model as one left-padded batch.

    Returns the new batch (``last_tokens`` still unset) and the logits of each row's last position.
    """
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)
    lengths = mask.sum(-1)
    batch = Batch(cache=cache, mask=mask, positions=lengths, last_tokens=torch.zeros_like(lengths))
    return batch, out.logits[:, -1, :]
