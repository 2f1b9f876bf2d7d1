"""Writing a task's event log: the append script's call, its arguments and its typed reply; and the
token checkpoint, which the same call writes and a resuming run reads back.

A running task's events reach Redis only through ``scripts.APPEND``, one call per batch: the
events, numbered from ``first_id``; the generated token ids they were made from (the checkpoint,
from ``token_offset``); and, with the last batch, the task's final status and response. The script
applies a batch only if it starts where the stored log ends and the caller still holds the lease.
Its reply says which check failed and what is stored, so that a writer tells a batch it sent
before, that did land although its answer was lost, from a batch that lost the task.

The task store (``tasks.TaskStore``: claim, cancel, renew, release, requeue) and this module make
every call of the task scripts; readers of the log use ``eventlog``.
"""

import enum
import functools
import struct
from collections.abc import Sequence

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import keys, scripts
from lmsp_core.store.tasks import eventlog


class Final(msgspec.Struct, frozen=True):
    """How a task ends, written with its last batch: status, response object, problem (if failed)."""

    status: wire.ResponseStatus
    response: bytes
    error: bytes = b""


class Append(msgspec.Struct, frozen=True, kw_only=True):
    """One call of the append script, by the run that holds ``lease``."""

    task_id: str
    response_id: str
    lease: str
    first_id: int  # the number of the first event
    events: tuple[tuple[str, bytes], ...]  # (name, the JSON that goes on the wire)
    token_offset: int  # how many tokens the checkpoint holds before these
    tokens: tuple[int, ...] = ()
    final: Final | None = None

    @property
    def last_id(self) -> int:
        return self.first_id + len(self.events) - 1

    @property
    def token_end(self) -> int:
        return self.token_offset + len(self.tokens)


class AppendOutcome(enum.StrEnum):
    STORED = "stored"  # applied by this call
    STORED_BEFORE = "stored_before"  # an earlier send of the same batch landed (its answer was lost)
    FENCED = "fenced"  # the log ends where ours does, but the lease is not ours: the task was taken over
    # the stored log does not end where ours does, nor does it hold this batch: another run wrote it,
    # or a Redis crash or failover lost what we had stored
    DIVERGED = "diverged"


class AppendReply(msgspec.Struct, frozen=True, kw_only=True):
    outcome: AppendOutcome
    cancel_requested: bool = False  # stored, task not final: someone asked to cancel the task
    # what the log holds (told when the batch did not follow it)
    stored_events: int | None = None
    stored_tokens: int | None = None

    @property
    def stored(self) -> bool:
        return self.outcome in (AppendOutcome.STORED, AppendOutcome.STORED_BEFORE)


def reply_of(append: Append, answer: list[bytes | int]) -> AppendReply:
    """The typed reply of the append script to ``append`` (see ``scripts.APPEND``)."""
    kind = answer[0].decode() if isinstance(answer[0], bytes) else str(answer[0])
    if kind == "appended":
        return AppendReply(outcome=AppendOutcome.STORED, cancel_requested=bool(int(answer[1])))
    if kind == "not_held":
        return AppendReply(outcome=AppendOutcome.FENCED)
    if kind != "mismatch":
        raise ValueError(f"unknown reply of the append script: {answer!r}")
    events, tokens = int(answer[1]), int(answer[2])
    # a log that reaches as far as this batch's events and tokens is taken to hold it (sent before,
    # landed). A log another run extended as far looks the same; the run that sent the batch is then
    # fenced at its next append (the lease check) or by its lease renewal, having written nothing
    landed = events >= append.last_id and tokens >= append.token_end
    return AppendReply(outcome=AppendOutcome.STORED_BEFORE if landed else AppendOutcome.DIVERGED,
                       stored_events=events, stored_tokens=tokens)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """How token ids are stored (the checkpoint, a task's rendered prompt): uint32 little-endian."""
    return struct.pack(f"<{len(tokens)}I", *tokens)


def unpack_tokens(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 4}I", raw)


async def read_tokens(redis: Redis, task_id: str) -> tuple[int, ...]:
    """The task's token checkpoint: every token id whose events are stored, in order."""
    return unpack_tokens(await redis.get(keys.token_ids(task_id)) or b"")


class EventStore:
    """Appends to task logs. Settings give the lease extension and the retention of a final task."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self._script = redis.register_script(scripts.APPEND)
        self._sha = self._script.sha.encode()
        self._lease_ttl_ms = int(settings.lease_ttl * 1000)
        self._event_ttl_ms = int(settings.event_retention * 1000)
        self._task_ttl_ms = int(settings.task_retention * 1000)

    async def load_script(self) -> None:
        """Load the script into Redis (one that restarted, or a promoted replica, has none of ours)."""
        await self.redis.script_load(scripts.APPEND)

    def add_to(self, pipe: Pipeline, append: Append) -> None:
        """Queue the call in ``pipe``; its answer goes to ``reply_of``. EVALSHA straight into the
        pipeline: redis-py's Script would ask SCRIPT EXISTS first, a second round trip; a Redis
        that lost its scripts answers NOSCRIPT instead (then ``load_script`` and send again)."""
        # (the command name as text: a cluster pipeline looks it up to find the keys' slot)
        pipe.execute_command("EVALSHA", self._sha, *_call_keys(append.task_id), *self._args(append))

    async def append(self, append: Append) -> AppendReply:
        """One append on its own (loads the script when Redis lacks it)."""
        answer = await self._script(keys=keys.script_keys(append.task_id), args=self._args(append))
        return reply_of(append, answer)

    def _args(self, append: Append) -> tuple[bytes, bytes]:
        """The call's two arguments (``scripts.APPEND``): the call packed, and the token bytes."""
        final = append.final
        fields: list[str | int | bool] = [
            append.lease, append.first_id, append.token_offset, self._lease_ttl_ms, final is not None,
            final.status if final else "", final.response.decode() if final else "",
            final.error.decode() if final else "", self._event_ttl_ms, self._task_ttl_ms,
        ]
        for name, data in append.events:
            code, stored = eventlog.pack(name, data, append.response_id)
            fields += (code, stored.decode())  # JSON: UTF-8, which Redis's MessagePack takes as strings
        return _MSGPACK.encode(fields), pack_tokens(append.tokens)


_MSGPACK = msgspec.msgpack.Encoder()


@functools.lru_cache(maxsize=4096)
def _call_keys(task_id: str) -> tuple[bytes, ...]:
    """The key count and keys of a task's append, as the call sends them: a flush sends one call for
    each running task, and what each costs to pack follows its arguments that are not bytes."""
    task_keys = keys.script_keys(task_id)
    return (b"%d" % len(task_keys), *(key.encode() for key in task_keys))
