"""Helpers of the fault-injection tests: groups of real processes to break, and the checks that a
task's log survived the break (numbered 1..n without gap or repeat, one final event, the text of an
uninterrupted run)."""

import json
import tempfile
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx

from lmsp_core import wire
from lmsp_core.settings import load_settings
from lmsp_core.store import connections, keys
from tests.support import (
    Api,
    RedisServer,
    SseEvent,
    Worker,
    collect,
    logged,
    sse_events,
    start_all,
    stop_all,
    tiny_spec,
)

if TYPE_CHECKING:
    from tests.rediscluster import LocalCluster
    from tests.replication import ReplicatedRedis

    AnyRedis = RedisServer | ReplicatedRedis | LocalCluster


def models_file(specs: list[dict[str, Any]]) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(specs, handle)
    return handle.name


def tiny(model_id: str, **fields: Any) -> dict[str, Any]:
    """A model spec with tiny-random's weights (the same seed, so the same greedy text)."""
    return tiny_spec(model_id, **fields)


def text_of(log: list[SseEvent]) -> str:
    return "".join(e.data["delta"] for e in log if e.event == wire.TEXT_DELTA)


def assert_exactly_once(log: list[SseEvent], final: str | None = None) -> None:
    """Events 1..n, each once, in order; exactly one final event, the last."""
    assert [e.id for e in log] == list(range(1, len(log) + 1)), [e.id for e in log]
    names = [e.event for e in log]
    assert sum(name in wire.FINAL_EVENTS for name in names) == 1, names[-5:]
    assert names[-1] in wire.FINAL_EVENTS
    if final is not None:
        assert names[-1] == final, log[-1]
    # one message item, whose id every delta carries
    items = {e.data["item"]["id"] for e in log if e.event == wire.ITEM_ADDED}
    assert len(items) <= 1 and {e.data["item_id"] for e in log if e.event == wire.TEXT_DELTA} <= items


class Group:
    """Real processes around one Redis (a redis-server, or one that fails over): API processes and
    workers, which tests kill and restart."""

    def __init__(self, redis: "AnyRedis", apis: list[Api], workers: list[Worker]) -> None:
        self.redis_server = redis
        self.apis = apis
        self.workers = workers
        self.redis = connections.connect(load_settings({}, **redis.settings))
        self.http = httpx.AsyncClient(base_url=apis[0].url, timeout=60)

    @classmethod
    async def start(cls, redis: "AnyRedis", apis: list[Api], workers: list[Worker]) -> "Group":
        try:
            await start_all(*workers, *apis)  # side by side
        except BaseException:
            stop_all(*apis, *workers)
            raise
        return cls(redis, apis, workers)

    async def close(self) -> None:
        await self.http.aclose()
        await connections.close(self.redis)
        processes = [*self.apis, *self.workers]
        for process in processes:  # all stop at once, then each is waited for
            process.terminate()
        for process in processes:
            process.stop()
        self.redis_server.cleanup()

    async def create(self, request: dict[str, Any], client: httpx.AsyncClient | None = None) -> str:
        response = await (client or self.http).post("/lmsp/v1/tasks", json=request)
        assert response.status_code == 202, response.text
        task_id: str = response.json()["id"]
        return task_id

    async def log(self, task_id: str, after: int = 0, client: httpx.AsyncClient | None = None) -> list[SseEvent]:
        return logged(await collect(client or self.http, "GET", f"/lmsp/v1/tasks/{task_id}/events?after={after}"))

    async def reference(self, request: dict[str, Any]) -> str:
        """The text of an uninterrupted run."""
        log = await self.log(await self.create(request))
        assert_exactly_once(log)
        return text_of(log)

    async def field(self, task_id: str, name: str) -> str | None:
        raw = await self.redis.hget(keys.task(task_id), name)
        return None if raw is None else str(raw.decode())

    async def attempts(self, task_id: str) -> int:
        return int(await self.field(task_id, "attempts") or 0)

    def worker_with_id(self, worker_id: str) -> Worker:
        pid = int(worker_id.rsplit("-", 2)[1])
        return next(w for w in self.workers if w.process is not None and w.process.pid == pid)

    async def holder(self, task_id: str) -> Worker:
        worker_id = await self.field(task_id, "worker")
        assert worker_id is not None
        return self.worker_with_id(worker_id)

    async def follow_and_act(self, task_id: str, text_length: int,
                             act: Callable[[], Awaitable[None]]) -> list[SseEvent]:
        """Follow the task's events to the end, calling ``act`` once, when its text has at least
        ``text_length`` characters (a delta carries the tokens between two appends: count text, not
        events)."""
        log: list[SseEvent] = []
        acted = False
        async for event in sse_events(self.http, "GET", f"/lmsp/v1/tasks/{task_id}/events"):
            log += logged([event])
            if not acted and len(text_of(log)) >= text_length:
                acted = True
                await act()
        return log
