"""The consumer of ended tasks: turns each into its webhook events, in whichever API process reads it.

Every API process reads the stream of ended tasks (``lmsp_core.store.tasks.finished``) in one consumer
group, so each entry goes to one of them; it reads the task's record and emits the events its end
causes (``task_events``), then acknowledges the entry. An entry that a process took and never
acknowledged (it died, or Redis failed mid-way) is claimed by another after ``CLAIM_IDLE``
seconds. An entry may thus be handled twice, as a task's end may be announced twice: ``emit`` is
idempotent per event id, which each event derives from the task's id.
"""

import asyncio
import logging
import time
from typing import NamedTuple

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from api.background.outage import Outage
from lmsp_core import wire
from lmsp_core.store import keys
from lmsp_core.store.objects import webhooks
from lmsp_core.wire import ids

logger = logging.getLogger(__name__)

GROUP = "webhooks"
READ_COUNT = 100
BLOCK = 5.0  # seconds a read waits for new entries
CLAIM_IDLE = 30.0  # seconds an entry stays with a consumer before another may claim it
CLAIM_EVERY = 10.0  # seconds between looks for such entries
FORGET_IDLE = 3600.0  # a consumer with nothing pending, silent this long (a process gone), leaves the group
FORGET_EVERY = 600.0

Event = tuple[str, dict[str, str], str]  # type, data, event id
# what the events of a task's end need of its record (not its request, prompt or response: large)
_FIELDS = ["owner", "kind", "status", "response_id", "batch", "finished_at", "trace"]


class TaskEnd(NamedTuple):
    id: str
    owner: str
    kind: str
    status: str
    response_id: str
    batch: str | None = None
    finished_at: float | None = None
    stored: bool = False  # its response is stored (store: true)
    trace: str | None = None  # its traceparent: the deliveries join the task's trace


async def task_end(redis: Redis, task_id: str) -> TaskEnd | None:
    """What the task's record says of its end (None: it has expired)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hmget(keys.task(task_id), _FIELDS)
        pipe.exists(keys.stored(task_id))
        fields, stored = await pipe.execute()
    found = {name: value.decode() for name, value in zip(_FIELDS, fields, strict=True) if value is not None}
    if "status" not in found:
        return None
    return TaskEnd(id=task_id, owner=found["owner"], kind=found["kind"], status=found["status"],
                   response_id=found["response_id"], batch=found.get("batch"),
                   finished_at=float(found["finished_at"]) if "finished_at" in found else None, stored=bool(stored),
                   trace=found.get("trace"))


def task_events(record: TaskEnd) -> list[Event]:
    """The webhook events of a task's end: ``response.<status>`` where its response is stored,
    ``task.<status>`` for every task; none for a direct response, a batch's line or a task that has
    not ended."""
    if record.kind != "task" or record.batch is not None or record.status not in wire.FINAL_STATUSES:
        return []
    status = record.status
    events: list[Event] = []
    if record.stored:
        events.append((f"response.{status}", {"id": record.response_id}, f"evt_{record.id}_response_{status}"))
    events.append((f"task.{status}", {"id": record.id, "response_id": record.response_id},
                   f"evt_{record.id}_task_{status}"))
    return events


class FinishedConsumer:
    NAME = "webhook consumer"  # in its log lines

    def __init__(self, redis: Redis, stream: str | None = None, group: str = GROUP) -> None:
        self.redis = redis
        self.stream = stream or keys.finished()
        self.group = group
        self.claim_idle = CLAIM_IDLE
        self.block = BLOCK
        self.name = ids.new_id("api")  # this process, in the group
        self._claimed_at = 0.0
        self._forgot_at = time.monotonic()

    async def run(self) -> None:
        outage = Outage(self.NAME, logger)
        joined = False
        while True:
            try:
                if not joined:
                    await self.join()
                    joined = True
                await self.step()
            except ResponseError as exc:
                joined = "NOGROUP" not in str(exc)  # the stream went (a Redis without persistence restarted)
                if joined:
                    logger.warning("%s: %s", self.NAME, exc)
                    await asyncio.sleep(1)
            except (RedisError, OSError) as exc:
                outage.failed(exc)
                await asyncio.sleep(1)
            else:
                outage.recovered()

    async def join(self) -> None:
        """Create the group if there is none, from the stream's start: ends announced before any
        API process ran are not lost."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def step(self) -> None:
        """Handle what others left unacknowledged (now and then), then what is new."""
        if time.monotonic() - self._claimed_at >= CLAIM_EVERY:
            await self.claim_stale()
            self._claimed_at = time.monotonic()
        if time.monotonic() - self._forgot_at >= FORGET_EVERY:
            await self.forget_gone()
            self._forgot_at = time.monotonic()
        reply = await self.redis.xreadgroup(self.group, self.name, {self.stream: ">"}, count=READ_COUNT,
                                            block=max(1, int(self.block * 1000)))
        for _, entries in reply or []:
            await self.handle(entries)

    async def claim_stale(self) -> None:
        start = "0-0"
        while True:
            reply = await self.redis.xautoclaim(self.stream, self.group, self.name, int(self.claim_idle * 1000),
                                                start_id=start, count=READ_COUNT)
            start, entries = reply[0], reply[1]
            await self.handle(entries)
            if start in (b"0-0", "0-0"):
                return

    async def forget_gone(self) -> None:
        for consumer in await self.redis.xinfo_consumers(self.stream, self.group):
            name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
            if name != self.name and not consumer["pending"] and consumer["idle"] >= FORGET_IDLE * 1000:
                await self.redis.xgroup_delconsumer(self.stream, self.group, name)

    async def handle(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for entry_id, fields in entries:
            task_id = fields.get(b"task")
            if task_id:
                await self.announce(task_id.decode())
            await self.redis.xack(self.stream, self.group, entry_id)

    async def announce(self, task_id: str) -> int:
        """Emit the events of a task's end; returns the deliveries created."""
        record = await task_end(self.redis, task_id)
        if record is None:
            return 0
        created = 0
        for event_type, data, event_id in task_events(record):
            created += await webhooks.emit(self.redis, record.owner, event_type, data, event_id,
                                           created_at=record.finished_at, trace=record.trace)
        return created
