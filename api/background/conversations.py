"""The settler of conversations' turns: each ended task that is a turn of a conversation has its
output put in the conversation, in whichever API process reads its end.

It reads the stream of ended tasks in a consumer group of its own, as webhooks' consumer does
(``api.background.webhooks.consumer``: at least once, an entry another process left unacknowledged
is claimed), so that a background response that nobody follows is settled too, and before its task's
record expires. Settling is idempotent (``lmsp_core.store.objects.conversationobjects``), and a
reader of the conversation settles what it meets first as well.
"""

import asyncio
import contextlib

from api.background.webhooks.consumer import FinishedConsumer
from api.process import Services

GROUP = "conversations"


class TurnSettler(FinishedConsumer):
    NAME = "conversation settler"

    def __init__(self, services: Services) -> None:
        super().__init__(services.redis, group=GROUP)
        self.conversations = services.conversation_objects
        self._task: asyncio.Task[None] | None = None

    async def announce(self, task_id: str) -> int:
        return int(await self.conversations.settle_task(task_id))

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="conversation-settler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
