"""Webhooks, the HTTP side (docs/protocol.md, "Webhooks"): every API process runs a consumer of
ended tasks (``consumer``), which emits their events, and a sender of due deliveries (``sender``),
which signs (``signing``) and posts them to checked addresses (``targets``). What is stored, and
``emit`` itself, are ``lmsp_core.store.objects.webhooks``'s."""

import asyncio
import contextlib

from api.background.webhooks.consumer import FinishedConsumer
from api.background.webhooks.sender import Sender
from api.process import Services


class Webhooks:
    """The process's consumer and sender, started with the app and stopped with it."""

    def __init__(self, services: Services) -> None:
        self.consumer = FinishedConsumer(services.redis)
        self.sender = Sender(services.redis, services.settings)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.consumer.run(), name="webhook-consumer"),
                       asyncio.create_task(self.sender.run(), name="webhook-sender")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.sender.close()
