"""Fixtures of the unit tests: the session's redis-server (``tests/conftest.py``), no other process."""

import pytest
import redis.asyncio as aioredis

from lmsp_core.settings import Settings
from lmsp_core.store.tasks.eventstore import EventStore
from lmsp_core.store.tasks.records import TaskStore
from tests.support import RedisServer
from tests.unit.tasks import model_id


@pytest.fixture
def settings(redis_server: RedisServer) -> Settings:
    return Settings(redis_url=redis_server.url)


@pytest.fixture
def model() -> str:
    return model_id()


@pytest.fixture
def store(redis: aioredis.Redis, settings: Settings) -> TaskStore:
    return TaskStore(redis, settings)


@pytest.fixture
def events(redis: aioredis.Redis, settings: Settings) -> EventStore:
    return EventStore(redis, settings)
