"""Grammar-constrained decoding with llguidance: one matcher per sequence, masks applied in the
engine's step on the batch's logits (see ``sampling.LogitsConstraint``)."""

import logging
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from lmsp_core.chat import ModelCard

logger = logging.getLogger(__name__)


def tokenizer_for(card: ModelCard) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (about a second to build: keep one per model)."""
    return llguidance.LLTokenizer(card.tokenizer_json, eos_token=list(card.stop_token_ids))


class GrammarConstraint:
    """Masks every token the grammar does not allow next; ``done`` once the grammar is complete."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, generated: Sequence[int] = ()) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._vocab = tokenizer.vocab_size
        if generated and not self._matcher.consume_tokens(list(generated)):
            raise ValueError(f"stored tokens do not follow the grammar: {self._matcher.get_error()}")
        if self._matcher.is_error():
            raise ValueError(self._matcher.get_error())

    def mask(self, logits: torch.Tensor) -> None:
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self._vocab].astype(np.bool_)).to(logits.device)
        logits[: self._vocab].masked_fill_(~allowed, float("-inf"))
        logits[self._vocab:] = float("-inf")

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            logger.error("a token the grammar did not allow was generated: %s", self._matcher.get_error())

    def done(self) -> bool:
        return bool(self._matcher.is_stopped())
