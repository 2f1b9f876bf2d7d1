"""Grammar-constrained decoding with llguidance: one matcher per sequence, whose mask of allowed
tokens the engine applies to the sequence's row in each step (see ``sampling.LogitsConstraint``)."""

import logging
from collections.abc import Sequence

import llguidance
import torch

from lmsp_core.requests.chat import ModelCard

logger = logging.getLogger(__name__)


def tokenizer_for(card: ModelCard) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (about a second to build: keep one per model)."""
    return llguidance.LLTokenizer(card.tokenizer_json, eos_token=list(card.stop_token_ids))


class GrammarConstraint:
    """Masks every token the grammar does not allow next; ``done`` once the grammar is complete."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, generated: Sequence[int] = ()) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._words = (tokenizer.vocab_size + 31) // 32
        if generated and not self._matcher.consume_tokens(list(generated)):
            raise ValueError(f"stored tokens do not follow the grammar: {self._matcher.get_error()}")
        if self._matcher.is_error():
            raise ValueError(self._matcher.get_error())

    def allow(self, bitmask: torch.Tensor) -> None:
        bitmask[self._words:].zero_()  # the model's rows beyond the tokenizer's vocabulary
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), self._words * 4)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            logger.error("a token the grammar did not allow was generated: %s", self._matcher.get_error())

    def done(self) -> bool:
        return bool(self._matcher.is_stopped())
