"""Token ids -> text deltas that never split a UTF-8 character."""

from collections.abc import Iterable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token: int) -> str:
        """The text that token completes ('' while a character is still incomplete)."""
        delta = self._stream.step(self._tokenizer, token) or ""
        if delta:
            self._chunks.append(delta)
        return delta

    def replay(self, tokens: Iterable[int]) -> str:
        """Feed tokens generated before a resume; returns their text."""
        return "".join(self.push(token) for token in tokens)
