"""Log-probabilities as the wire gives them: each token spelled as the tokenizer writes it.

The engine reports a chosen token's log-probability and the most likely tokens' as ids
(``workers.engine.sampling.Scores``); here they become ``wire.TokenLogprob`` entries with each token's
text and exact bytes. A token that is part of a UTF-8 character has its bytes, and its text shows
them as ``\\xNN`` escapes.
"""

import llguidance

from lmsp_core import wire
from workers.engine.sampling import Scores


class LogprobSpeller:
    """Spells tokens for log-probability entries (one per model: spellings are kept)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self._tokenizer = tokenizer
        self._spelled: dict[int, tuple[str, list[int]]] = {}

    def spell(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes (none for an id past the tokenizer's, which a model may have)."""
        found = self._spelled.get(token)
        if found is None:
            raw = self._tokenizer.decode_bytes([token]) if 0 <= token < self._tokenizer.vocab_size else b""
            found = self._spelled[token] = (raw.decode("utf-8", "backslashreplace"), list(raw))
        return found

    def entry(self, token: int, scores: Scores) -> wire.TokenLogprob:
        text, raw = self.spell(token)
        return wire.TokenLogprob(token=text, logprob=scores.logprob, bytes=raw,
                                 top_logprobs=[self._top(other, logprob) for other, logprob in scores.top])

    def _top(self, token: int, logprob: float) -> wire.TopLogprob:
        text, raw = self.spell(token)
        return wire.TopLogprob(token=text, logprob=logprob, bytes=raw)
