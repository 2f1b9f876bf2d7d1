"""What the route handlers share in one API process: settings, the catalog, Redis and the stores.

Created at start-up (the Redis connection is opened lazily, so the API starts, and answers 503
problem documents, while Redis is down) and handed to handlers by dependency injection.
"""

from dataclasses import dataclass, field
from pathlib import Path

from arq.connections import ArqRedis

from api.eventhub import EventHub
from api.limits import Limits
from api.metrics import ApiMetrics
from api.modeltext import ModelText, Tokenizers
from lmsp_core.requests.catalog import Catalog
from lmsp_core.settings import Settings
from lmsp_core.store import connections
from lmsp_core.store.objects.conversationobjects import ConversationObjects
from lmsp_core.store.objects.conversations import ConversationStore
from lmsp_core.store.objects.files import FileStore
from lmsp_core.store.tasks.records import TaskStore


@dataclass
class Services:
    settings: Settings
    catalog: Catalog
    redis: ArqRedis
    store: TaskStore
    hub: EventHub
    limits: Limits
    conversations: ConversationStore  # stored responses and their chains (previous_response_id)
    conversation_objects: ConversationObjects  # OpenAI's conversation objects (/v1/conversations)
    replicas: connections.ReplicaWatch
    tokenizers: Tokenizers
    files: FileStore
    metrics: ApiMetrics = field(default_factory=ApiMetrics)

    @classmethod
    def create(cls, settings: Settings) -> "Services":
        redis = connections.connect(settings, health_check_interval=30)
        catalog = Catalog.from_settings(settings)
        replicas = connections.ReplicaWatch(settings)
        return cls(settings=settings, catalog=catalog, redis=redis,
                   tokenizers=Tokenizers(catalog, Path(settings.model_cache)),
                   store=TaskStore(redis, settings, replicas), hub=EventHub(redis, settings.sse_heartbeat),
                   limits=Limits(redis, settings), conversations=ConversationStore(redis, settings),
                   replicas=replicas, files=FileStore(redis, settings, replicas),
                   conversation_objects=ConversationObjects(redis, settings, replicas))

    async def model_text(self, model_id: str) -> ModelText | None:
        """The model's prompt renderer and grammar tokenizer (``api.modeltext``)."""
        return await self.tokenizers.get(self.redis, model_id)

    async def close(self) -> None:
        await self.limits.close()
        await self.hub.close()
        await connections.close(self.redis)
