"""The task store: one Redis hash per task, changed atomically by the scripts in ``scripts``.

A task is the unit of work: the request, its owner, its status and its result. Direct requests
(``POST /responses``) are tasks too; only their lifetime differs. Status moves
``queued -> in_progress -> completed | incomplete | failed | cancelled`` (or ``queued -> cancelled``).
A worker holds a task through a lease (``lease``, ``lease_until``) that it renews while it runs;
a lapsed lease lets another worker claim the task and resume it. Every task is also entered in its
model's index of unfinished tasks (``taskindex``), where reapers find tasks nobody runs any more.
"""

import enum
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec
from redis.asyncio import Redis

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import cluster, connections, keys, metrics, scripts
from lmsp_core.store.connections import ReplicaWatch
from lmsp_core.store.tasks import eventlog, finished, queue
from lmsp_core.store.tasks.eventstore import unpack_tokens
from lmsp_core.store.tasks.fairqueue import FairQueue
from lmsp_core.store.tasks.taskindex import ActiveIndex
from lmsp_core.wire import ids

Kind = Literal["task", "direct"]

INDEX_CAP = 10_000  # entries kept per owner in the listing index


class ListCursor(msgspec.Struct, frozen=True):
    """Position in an owner's listing: the last task seen (creation time in ms, id). Listings are
    ordered by creation time, then by id, both descending (the order of ZREVRANGEBYSCORE)."""

    created_ms: int
    task_id: str

    def encode(self) -> str:
        return f"{self.created_ms}.{self.task_id}"

    # what ``encode`` writes: milliseconds (13 digits until the year 2286), a dot, a task id
    PATTERN: ClassVar[str] = rf"[0-9]{{1,15}}\.{ids.pattern(ids.TASK)}"

    @classmethod
    def decode(cls, raw: str) -> "ListCursor | None":
        if re.fullmatch(cls.PATTERN, raw) is None:
            return None
        head, _, task_id = raw.partition(".")
        return cls(int(head), task_id)

    @classmethod
    def after(cls, record: "TaskRecord") -> "ListCursor":
        return cls(int(record.created_at * 1000), record.id)

    def before(self, member: bytes, score: float) -> bool:
        """Whether an index entry comes after this cursor in listing order."""
        return score < self.created_ms or (score == self.created_ms and member.decode() < self.task_id)


class TaskRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    model: str
    owner: str
    kind: Kind
    status: wire.TaskStatus
    created_at: float
    response_id: str
    request: bytes
    started_at: float | None = None
    finished_at: float | None = None
    response: bytes | None = None
    error: bytes | None = None
    last_event_id: int = 0
    attempts: int = 0
    cancel_requested: bool = False
    worker: str | None = None  # the worker that claimed it last
    job: str | None = None  # the arq job meant to run it (None: the first job, whose id is the task id)
    # the whole input (earlier turns of a conversation + this request's), when it differs from the request's
    context: bytes | None = None
    # the prompt as the API rendered and checked it (token ids, uint32 little-endian) and the digest of
    # the model card it used; None where the API had no card: the worker renders and checks it then
    prompt: bytes | None = None
    prompt_card: str | None = None
    # the request's x-metadata (JSON), which every response object of the task carries
    metadata: bytes | None = None
    # what its principal is charged when it starts (fairqueue.cost); 0: not known (an older record)
    cost: int = 0
    batch: str | None = None  # the batch whose line it runs (OpenAI's Batch API)
    trace: str | None = None  # the W3C traceparent its spans join (lmsp_core.tracing), on every worker

    def prompt_ids(self, card_digest: str) -> list[int] | None:
        """The prompt the API rendered, if it used the card the worker has (else None)."""
        if self.prompt is None or self.prompt_card != card_digest:
            return None
        return list(unpack_tokens(self.prompt))

    def input_items(self, request: wire.ResponseRequest) -> list[wire.InputItem]:
        if self.context is None:
            return list(request.input)
        return msgspec.json.decode(self.context, type=list[wire.InputItem])

    @property
    def final(self) -> bool:
        return self.status in wire.FINAL_STATUSES

    def response_object(self) -> wire.Response | None:
        return msgspec.json.decode(self.response, type=wire.Response) if self.response else None

    def metadata_map(self) -> dict[str, str] | msgspec.UnsetType:
        """The task's metadata, as response and task objects carry it (UNSET: none)."""
        return msgspec.json.decode(self.metadata, type=dict[str, str]) if self.metadata else msgspec.UNSET

    def problem(self) -> wire.Problem | None:
        return msgspec.json.decode(self.error, type=wire.Problem) if self.error else None

    def to_wire(self) -> wire.Task:
        return wire.Task(
            id=self.id,
            status=self.status,
            created_at=int(self.created_at),
            started_at=None if self.started_at is None else int(self.started_at),
            finished_at=None if self.finished_at is None else int(self.finished_at),
            model=self.model,
            response_id=self.response_id,
            response=self.response_object(),
            error=self.problem(),
            metadata=self.metadata_map(),
            batch_id=self.batch if self.batch is not None else msgspec.UNSET,
        )


_TEXT_FIELDS = ("id", "model", "owner", "kind", "status", "response_id")
_OPTIONAL_TEXT_FIELDS = ("worker", "job", "prompt_card", "batch", "trace")
_FLOAT_FIELDS = ("created_at", "started_at", "finished_at")
_INT_FIELDS = ("last_event_id", "attempts", "cost")


def metadata_of(request: wire.ResponseRequest) -> bytes | None:
    """A new task's ``metadata``: its request's ``x-metadata``, encoded (None: none)."""
    metadata = request.known_extensions.metadata
    return None if metadata is None else wire.encoder.encode(metadata)


def _record(raw: dict[bytes, bytes]) -> TaskRecord:
    fields = {k.decode(): v for k, v in raw.items()}
    data: dict[str, Any] = {name: fields[name].decode() for name in _TEXT_FIELDS}
    data.update({name: fields[name].decode() for name in _OPTIONAL_TEXT_FIELDS if name in fields})
    data.update({name: float(fields[name]) for name in _FLOAT_FIELDS if name in fields})
    data.update({name: int(fields[name]) for name in _INT_FIELDS if name in fields})
    data.update({name: fields[name] for name in ("request", "response", "error", "context", "prompt", "metadata")
                 if name in fields})
    data["cancel_requested"] = "cancel" in fields
    return msgspec.convert(data, TaskRecord)


class ClaimOutcome(enum.StrEnum):
    CLAIMED = "claimed"  # the job's run holds the task now
    EXHAUSTED = "exhausted"  # claimed max_attempts times before: failed now (worker_lost)
    HELD = "held"  # another run holds it under a live lease
    FINAL = "final"  # it has ended
    MISSING = "missing"  # no such task (expired)


class Claim(msgspec.Struct, frozen=True):
    """Outcome of a worker's claim on a task, and what a claimed task's run resumes from."""

    outcome: ClaimOutcome
    last_event_id: int = 0
    attempts: int = 0
    cancel_requested: bool = False


class CancelOutcome(enum.StrEnum):
    DEQUEUED = "dequeued"  # it was queued: cancelled now, its log ends with response.cancelled
    STOPPING = "stopping"  # it runs: its worker stops it within a few tokens (the cancel flag)
    FINAL = "final"  # it had ended: left as it is
    MISSING = "missing"


class TaskStore:
    """Tasks' records, claims and cancels. With ``replicas`` (the API's), the writes a client is
    answered for (``replicated``, ``cancel(..., replicated=True)``) wait for the replicas."""

    def __init__(self, redis: Redis, settings: Settings, replicas: ReplicaWatch | None = None) -> None:
        self.redis = redis
        self.settings = settings
        self.replicas = replicas
        self._claim = redis.register_script(scripts.CLAIM)
        self._cancel = redis.register_script(scripts.CANCEL)
        self._renew = redis.register_script(scripts.RENEW)
        self._release = redis.register_script(scripts.RELEASE)
        self._requeue = redis.register_script(scripts.REQUEUE)
        self.index = ActiveIndex(redis)
        self.fair = FairQueue(redis)

    @property
    def event_ttl_ms(self) -> int:
        return int(self.settings.event_retention * 1000)

    @property
    def task_ttl_ms(self) -> int:
        return int(self.settings.task_retention * 1000)

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.settings.lease_ttl * 1000)

    @property
    def index_ttl_ms(self) -> int:
        # a task ends at most job_timeout after it starts, then its record lives task_retention
        return self.task_ttl_ms + int(self.settings.job_timeout * 1000)

    async def create(self, record: TaskRecord) -> None:
        mapping: dict[str, str | bytes | float | int] = {
            name: getattr(record, name) for name in (*_TEXT_FIELDS, "created_at", "request", "cost")
        }
        for name in ("context", "prompt", "prompt_card", "metadata", "batch", "trace"):
            if (value := getattr(record, name)) is not None:
                mapping[name] = value
        async with self.redis.pipeline(transaction=False) as pipe:
            # a reaper first looks at the task after one lease period: by then its job is queued
            # (or the API died before queueing it, and the reaper queues it; see docs/reliability.md)
            await self.index.add(record.model, record.id, self.lease_ttl_ms, pipe=pipe)
            pipe.hset(keys.task(record.id), mapping=mapping)
            if record.kind == "task":  # direct responses are not listed
                index = keys.owner_tasks(record.owner)
                pipe.zadd(index, {record.id: int(record.created_at * 1000)})
                pipe.zremrangebyrank(index, 0, -INDEX_CAP - 1)
                pipe.pexpire(index, self.index_ttl_ms)
            await pipe.execute()

    async def delete(self, record: TaskRecord) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(keys.task(record.id))
            pipe.zrem(keys.owner_tasks(record.owner), record.id)
            await pipe.execute()

    async def list_owned(self, owner: str, limit: int,
                         cursor: ListCursor | None = None) -> tuple[list[TaskRecord], bool]:
        """An owner's tasks, newest first, after ``cursor``; and whether more follow."""
        index = keys.owner_tasks(owner)
        top = "+inf" if cursor is None else cursor.created_ms
        found: list[TaskRecord] = []
        offset = 0
        while len(found) <= limit:
            entries = await self.redis.zrevrangebyscore(index, top, "-inf", start=offset, num=limit + 1,
                                                        withscores=True)
            if not entries:
                break
            offset += len(entries)
            ids = [member.decode() for member, score in entries if cursor is None or cursor.before(member, score)]
            found += await self._present(index, ids)
        return found[:limit], len(found) > limit

    async def _present(self, index: str, ids: list[str]) -> list[TaskRecord]:
        """The records of ``ids`` that still exist; the others (expired) leave the index."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.hgetall(keys.task(task_id))
            raws = await pipe.execute()
        gone = [task_id for task_id, raw in zip(ids, raws, strict=True) if not raw]
        if gone:
            await self.redis.zrem(index, *gone)
        return [_record(raw) for raw in raws if raw]

    async def get(self, task_id: str) -> TaskRecord | None:
        raw = await self.redis.hgetall(keys.task(task_id))  # type: ignore[misc]
        return _record(raw) if raw else None

    async def replicated(self, task_id: str) -> bool:
        """Wait until the replicas hold every write made so far to the task's shard (at most the WAIT
        timeout), so that a failover keeps what the client is told; False: they did not confirm."""
        if self.replicas is None:
            return False
        return await connections.replicated(self.redis, self.replicas, keys.task(task_id))

    async def cancel(self, record: TaskRecord, *, replicated: bool = False) -> CancelOutcome:
        """Cancel a task (``scripts.CANCEL``): a queued one at once, a running one by its worker.
        With ``replicated``, return once the replicas hold the cancel too (``replicated``)."""
        outcome = await self._cancel_task(record)
        if replicated:
            await self.replicated(record.id)
        return outcome

    async def _cancel_task(self, record: TaskRecord) -> CancelOutcome:
        _, data = eventlog.pack(wire.CANCELLED, wire.encoder.encode(
            wire.ResponseCancelled(response_id=record.response_id, status="cancelled")), record.response_id)
        response = wire.encoder.encode(cancelled_response(record))
        status = (await self._cancel(
            keys=keys.script_keys(record.id),
            args=[data, response, self.event_ttl_ms, self.task_ttl_ms, record.id, keys.cancel_channel("")]
        )).decode()
        if status == "dequeued":  # only the call that cancelled it counts it
            await queue.withdraw(self.redis, record.job or keys.job_id(record.id, record.model), record.model)
            await finished.announce(self.redis, [record.id])
            await metrics.add_now(self.redis, metrics.FINISHED, (record.model, "cancelled"))
            return CancelOutcome.DEQUEUED
        if status == "in_progress":
            return CancelOutcome.STOPPING
        return CancelOutcome.MISSING if status == "missing" else CancelOutcome.FINAL

    async def claim(self, record: TaskRecord, worker_id: str, job_id: str, lease: str,
                    failure: wire.Problem, output: Sequence[wire.OutputItem] = ()) -> Claim:
        """Take a queued task, or one whose lease has lapsed, for the arq job ``job_id``. After
        ``max_attempts`` claims the task fails with ``failure`` instead, with ``output`` (what its
        stored events delivered), so a task that kills its worker cannot loop forever."""
        _, failed_data = eventlog.pack(wire.FAILED, wire.encoder.encode(wire.ResponseFailed(
            response_id=record.response_id, status="failed", error=failure, output=list(output))), record.response_id)
        failed_response = wire.encoder.encode(failed_response_object(record, failure, output))
        result = await self._claim(
            keys=keys.script_keys(record.id),
            args=[lease, self.lease_ttl_ms, self.settings.max_attempts, failed_data, failed_response,
                  wire.encoder.encode(failure), self.event_ttl_ms, self.task_ttl_ms, worker_id, job_id],
        )
        outcome = result[0].decode()
        if outcome == "claimed":
            return Claim(ClaimOutcome.CLAIMED, int(result[1]), int(result[2]), bool(result[3]))
        if outcome in ("exhausted", "missing"):
            return Claim(ClaimOutcome(outcome))
        return Claim(ClaimOutcome.HELD if outcome == "in_progress" else ClaimOutcome.FINAL)

    async def renew(self, leases: dict[str, str]) -> set[str]:
        """Extend held leases; returns the ids of tasks whose lease is no longer ours."""
        if not leases:
            return set()
        ttl = self.lease_ttl_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id, lease in leases.items():
                cluster.evalsha(pipe, self._renew, [keys.task(task_id)], [lease, ttl])
            results = await pipe.execute()
        return {task_id for task_id, ok in zip(leases, results, strict=True) if not ok}

    async def release(self, task_id: str, lease: str) -> bool:
        """Hand a held task back so that another worker claims it at once."""
        return bool(await self._release(keys=[keys.task(task_id)], args=[lease]))

    async def requeue(self, task_id: str, model_id: str) -> str | None:
        """A fresh job id for a task that nobody holds (see ``scripts.REQUEUE``), or None."""
        job = await self._requeue(keys=[keys.task(task_id)], args=[keys.job_id(task_id, model_id)])
        return None if job is None else str(job.decode())


def cancelled_response(record: TaskRecord) -> wire.Response:
    """The response object of a task cancelled before it produced anything."""
    return wire.Response(id=record.response_id, created_at=int(record.created_at), status="cancelled",
                         model=record.model, output=[], usage=None, metadata=record.metadata_map())


def failed_response_object(record: TaskRecord, problem: wire.Problem,
                           output: Sequence[wire.OutputItem] = ()) -> wire.Response:
    return wire.Response(id=record.response_id, created_at=int(record.created_at), status="failed",
                         model=record.model, output=list(output), usage=None, error=problem,
                         metadata=record.metadata_map())
