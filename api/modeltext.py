"""Each model's tokenizers in an API process: to count prompt tokens and size constrained output at submit.

The card a worker publishes wins (it is what the workers feed the model); before any worker has
published one, the card is read from the model's files (``lmsp_core.requests.modelfiles``), so that a
request that cannot fit is refused at submit even while no worker runs. A published card is
looked for again every ``CARD_REFRESH`` seconds.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis

from lmsp_core.requests.catalog import Catalog
from lmsp_core.requests.chat import ModelCard, PromptRenderer, card_digest
from lmsp_core.requests.closing import GrammarTokenizer
from lmsp_core.requests.modelfiles import card_from_files
from lmsp_core.store import registry

logger = logging.getLogger(__name__)

CARD_REFRESH = 30.0


class ModelText:
    """A model's prompt renderer, its card's digest and, built on first use (about a second), its
    grammar tokenizer."""

    def __init__(self, renderer: PromptRenderer, digest: str) -> None:
        self.renderer = renderer
        self.card_digest = digest  # what each task's rendered prompt names (hashing the card takes ms)
        self._grammar: GrammarTokenizer | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def of(cls, card: ModelCard) -> "ModelText":
        renderer, digest = await asyncio.to_thread(lambda: (PromptRenderer(card), card_digest(card)))
        return cls(renderer, digest)

    async def grammar(self) -> GrammarTokenizer:
        async with self._lock:
            if self._grammar is None:
                card = self.renderer.card
                self._grammar = await asyncio.to_thread(GrammarTokenizer.build, card.tokenizer_json,
                                                        card.stop_token_ids)
        return self._grammar


@dataclass
class _Cached:
    text: ModelText | None
    digest: str | None  # of the published card it came from; None: from files, or nothing
    checked_at: float


@dataclass
class Tokenizers:
    catalog: Catalog
    model_cache: Path
    _cached: dict[str, _Cached] = field(default_factory=dict)
    _from_files: dict[str, ModelText | None] = field(default_factory=dict)  # None: not at hand
    _files_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, redis: Redis, model_id: str) -> ModelText | None:
        """The model's tokenizers: from its published card, else from its files; None if neither is
        at hand (a model whose files only its workers have; they check the request then)."""
        cached = self._cached.get(model_id)
        if cached is not None and time.monotonic() - cached.checked_at < CARD_REFRESH:
            return cached.text
        digest = await registry.card_digest_of(redis, model_id)
        if cached is not None and cached.digest == digest:
            cached.checked_at = time.monotonic()
            return cached.text
        card = await registry.load_card(redis, model_id) if digest else None
        text = await ModelText.of(card) if card is not None else await self._files(model_id)
        self._cached[model_id] = _Cached(text, digest if card is not None else None, time.monotonic())
        return text

    async def _files(self, model_id: str) -> ModelText | None:
        async with self._files_lock:  # reading a GGUF's vocabulary takes seconds: once
            if model_id not in self._from_files:
                card = await asyncio.to_thread(card_from_files, self.catalog.get(model_id), self.model_cache)
                if card is not None:
                    logger.info("model %s: tokenizer read from files (no worker has published its card)", model_id)
                self._from_files[model_id] = None if card is None else await ModelText.of(card)
            return self._from_files[model_id]
