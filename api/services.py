"""What the route handlers share in one API process: settings, the catalog, Redis and the stores.

Created at start-up (the Redis connection is opened lazily, so the API starts, and answers 503
problem documents, while Redis is down) and handed to handlers by dependency injection.
"""

import asyncio
import time
from dataclasses import dataclass, field

from arq.connections import ArqRedis

from api.hub import EventHub
from api.limits import Limits
from api.metrics import ApiMetrics
from lmsp_core.requests.catalog import Catalog
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import Settings
from lmsp_core.store import connections, registry
from lmsp_core.store.conversations import ConversationStore
from lmsp_core.store.tasks import TaskStore

CARD_REFRESH = 30.0


@dataclass
class _CachedRenderer:
    renderer: PromptRenderer | None
    digest: str | None
    checked_at: float


@dataclass
class Services:
    settings: Settings
    catalog: Catalog
    redis: ArqRedis
    store: TaskStore
    hub: EventHub
    limits: Limits
    conversations: ConversationStore
    replicas: connections.ReplicaWatch
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    _renderers: dict[str, _CachedRenderer] = field(default_factory=dict)

    @classmethod
    def create(cls, settings: Settings) -> "Services":
        redis = connections.connect(settings, health_check_interval=30)
        return cls(settings=settings, catalog=Catalog.from_settings(settings), redis=redis,
                   store=TaskStore(redis, settings), hub=EventHub(redis, settings.sse_heartbeat),
                   limits=Limits(redis, settings), conversations=ConversationStore(redis, settings),
                   replicas=connections.ReplicaWatch(settings))

    async def renderer(self, model_id: str) -> PromptRenderer | None:
        """The prompt renderer of a model, from the card its workers publish (None before any
        worker for the model has started)."""
        cached = self._renderers.get(model_id)
        if cached is not None and time.monotonic() - cached.checked_at < CARD_REFRESH:
            return cached.renderer
        digest = await registry.card_digest_of(self.redis, model_id)
        if cached is not None and cached.digest == digest:
            cached.checked_at = time.monotonic()
            return cached.renderer
        card = await registry.load_card(self.redis, model_id) if digest else None
        renderer = None if card is None else await asyncio.to_thread(PromptRenderer, card)
        self._renderers[model_id] = _CachedRenderer(renderer, digest, time.monotonic())
        return renderer

    async def close(self) -> None:
        await self.limits.close()
        await self.hub.close()
        await self.redis.aclose()
