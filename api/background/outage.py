"""The background loops' one way through a Redis outage: every loop retries until Redis is back,
and says so once when the outage starts rather than at every retry."""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

from redis.exceptions import RedisError


class Outage:
    """Whether a loop's last round found Redis away; logs the start of each outage once."""

    def __init__(self, loop: str, logger: logging.Logger) -> None:
        self.loop = loop
        self.logger = logger
        self.failing = False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            self.logger.warning("%s: Redis unavailable (%s); retrying", self.loop, type(exc).__name__)
        self.failing = True

    def recovered(self) -> None:
        self.failing = False


async def poll(take: Callable[[], Awaitable[list[str]]], handle: Callable[[list[str]], Awaitable[None]], *,
               idle: float, outage: Outage) -> NoReturn:
    """Take what is due and handle it, forever; while nothing is due, or Redis is away, wait
    ``idle`` seconds between rounds."""
    while True:
        try:
            due = await take()
            await handle(due)
        except (RedisError, OSError) as exc:
            outage.failed(exc)
            due = []
        else:
            outage.recovered()
        if not due:
            await asyncio.sleep(idle)
