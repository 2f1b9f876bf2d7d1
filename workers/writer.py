"""Appending events to task streams, batched: one Redis round trip per flush for all tasks.

Runs add events and token checkpoints as tokens arrive; the writer numbers the events. A flush
sends every task's pending batches, each as one call of the append script, all in one pipeline,
so round trips do not grow with tokens x streams. The call, its arguments and its typed reply are
``lmsp_core.store.tasks.eventstore``'s.

Flushes come at most every ``event_flush_interval`` seconds, except where a run's first output or
its end waits (the first token and the final event go out at once): the tokens of the steps between
two flushes go in one batch, and a text delta added right after an unsent delta of the same item
joins it, so that a stream's event carries the text of several tokens and every cost that is paid
per event (the script, the stream entry, the API's read and SSE write) is paid once for them
(docs/protocol.md, "Text deltas"; docs/performance.md, "The path of an event").

A batch that failed to send stays queued and is sent again; a batch that Redis applied although its
answer was lost (the connection dropped) is recognised by its event number and token offset and
counted as done. The script's answer also carries the task's cancel flag, so a worker learns of a
cancellation without polling.

With replicas to wait for (``redis_wait_replicas``), the pipeline ends with ``WAIT``: a batch counts
as stored once a replica holds it too (or the wait timed out, or no replica is online: see
``lmsp_core.store.connections.ReplicaWatch``). Until then it stays here, so a batch
that a failover loses, although a follower may have seen it on the old primary, is written again,
the same bytes under the same numbers, to the new primary (docs/reliability.md).
"""

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from lmsp_core import wire
from lmsp_core.settings import Settings
from lmsp_core.store import cluster, connections, keys
from lmsp_core.store.tasks.eventstore import Append, AppendOutcome, AppendReply, EventStore, Final, reply_of

logger = logging.getLogger(__name__)

RETRY_DELAYS = (0.05, 0.1, 0.25, 0.5, 1.0)
DeltaEvent = wire.OutputTextDelta | wire.ReasoningSummaryTextDelta
DELTAS = (wire.TEXT_DELTA, wire.REASONING_DELTA)  # events whose text a later one of the same item extends


class Writable(Protocol):
    """What the writer needs from a running task."""

    @property
    def task_id(self) -> str: ...

    @property
    def lease(self) -> str: ...

    @property
    def response_id(self) -> str: ...

    def on_cancel_requested(self) -> None: ...

    def on_fenced(self) -> None: ...

    def on_final_durable(self) -> None: ...


def joined(last: DeltaEvent, data: DeltaEvent) -> DeltaEvent:
    """Two deltas of one item as one: their text, and their tokens' log-probabilities where they carry them."""
    if isinstance(last, wire.OutputTextDelta) and isinstance(data, wire.OutputTextDelta) \
            and (last.logprobs or data.logprobs):
        logprobs = [*(last.logprobs or ()), *(data.logprobs or ())]
        return msgspec.structs.replace(last, delta=last.delta + data.delta, logprobs=logprobs)
    return msgspec.structs.replace(last, delta=last.delta + data.delta)


@dataclass
class _Pending:
    first_id: int
    token_offset: int
    events: list[tuple[str, msgspec.Struct]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    final: Final | None = None
    sent: bool = False

    def add(self, name: str, data: msgspec.Struct) -> bool:
        """Add an event; returns whether it is a new one (False: its text joined the last delta)."""
        if name in DELTAS and self.events:
            last_name, last = self.events[-1]
            if last_name == name and isinstance(last, DeltaEvent) and isinstance(data, DeltaEvent) \
                    and last.item_id == data.item_id:
                self.events[-1] = (name, joined(last, data))
                return False
        self.events.append((name, data))
        return True

    def call(self, owner: Writable) -> Append:
        """The append script's call for this batch as it stands."""
        events = tuple((name, wire.encoder.encode(data)) for name, data in self.events)
        return Append(task_id=owner.task_id, response_id=owner.response_id, lease=owner.lease,
                      first_id=self.first_id, events=events, token_offset=self.token_offset,
                      tokens=tuple(self.tokens), final=self.final)


@dataclass
class _Log:
    """The writer's view of one task's log: what is numbered so far and what is not yet stored."""

    owner: Writable
    next_id: int
    token_count: int
    batches: deque[_Pending] = field(default_factory=deque)

    def open_batch(self) -> _Pending:
        if not self.batches or self.batches[-1].sent or self.batches[-1].final is not None:
            self.batches.append(_Pending(first_id=self.next_id, token_offset=self.token_count))
        return self.batches[-1]


class EventWriter:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self._store = EventStore(redis, settings)
        self._logs: dict[str, _Log] = {}
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()  # a run's first output waits: flush without waiting the interval
        self._interval = settings.event_flush_interval
        self._last_flush = 0.0
        self._flushed = asyncio.Condition()
        self._replicas = connections.ReplicaWatch(settings)
        self._replicas_short = False  # the last flush was not confirmed by replicas: on the primary alone

    # --- called by runs (on the event loop, never awaiting) -------------------------------------

    def open(self, run: Writable, last_event_id: int, token_count: int) -> None:
        self._logs[run.task_id] = _Log(owner=run, next_id=last_event_id + 1, token_count=token_count)

    def event(self, run: Writable, name: str, data: msgspec.Struct, urgent: bool = False) -> int | None:
        """Add an event; returns its number (None: the run's log is closed, the event dropped). A text
        delta may join the unsent one before it, and then has its number. ``urgent``: flush it
        without waiting for the interval (a run's first output)."""
        log = self._log_of(run)
        if log is None:
            return None
        if log.open_batch().add(name, data):
            log.next_id += 1
        self._dirty.set()
        if urgent:
            self._urgent.set()
        return log.next_id - 1

    def tokens(self, run: Writable, tokens: list[int]) -> None:
        log = self._log_of(run)
        if log is None:
            return
        log.open_batch().tokens.extend(tokens)
        log.token_count += len(tokens)
        self._dirty.set()

    def finalize(self, run: Writable, final: Final) -> None:
        """End the run's log with its last batch, flushed without waiting for the interval (a client
        that waits for the whole response waits for it)."""
        log = self._log_of(run)
        if log is None:
            return
        log.open_batch().final = final
        self._dirty.set()
        self._urgent.set()

    def close(self, task_id: str) -> None:
        """Forget a task; anything still unsent for it is dropped, and so is what its run adds later
        (a fenced run's engine step that was under way still delivers its tokens)."""
        self._logs.pop(task_id, None)

    def _log_of(self, run: Writable) -> _Log | None:
        # the task's log only if it is this run's: a later run of the same task here has its own
        log = self._logs.get(run.task_id)
        return log if log is not None and log.owner is run else None

    def unsent(self, task_id: str) -> bool:
        log = self._logs.get(task_id)
        return bool(log and log.batches)

    async def settled(self, task_id: str) -> None:
        """Return once everything added for the task is stored (or dropped)."""
        async with self._flushed:
            await self._flushed.wait_for(lambda: not self.unsent(task_id))

    # --- flushing --------------------------------------------------------------------------------

    async def run(self) -> None:
        failures = 0
        while True:
            await self._dirty.wait()
            await self._until_due()
            self._dirty.clear()
            self._urgent.clear()
            self._last_flush = time.monotonic()
            try:
                if failures:
                    # Redis came back, maybe as another server (a promoted replica) or without its
                    # scripts: load ours first rather than learn it from NOSCRIPT answers, which
                    # would cost a whole flush (and its WAIT) for nothing
                    await self._store.load_script()
                await self.flush()
                failures = 0
            except (RedisError, OSError) as exc:
                delay = RETRY_DELAYS[min(failures, len(RETRY_DELAYS) - 1)]
                failures += 1
                logger.warning("event flush failed (%s); retrying in %.2fs", type(exc).__name__, delay)
                self._dirty.set()
                await asyncio.sleep(delay)

    async def _until_due(self) -> None:
        """Wait until ``event_flush_interval`` has passed since the last flush, or something is urgent."""
        wait = self._last_flush + self._interval - time.monotonic()
        if wait > 0 and not self._urgent.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._urgent.wait()

    async def flush(self) -> None:
        """Send every pending batch. Where Redis lacked the append script (restarted, or a new server)
        it is loaded and the batches go again at once: what was added before a flush is stored when
        it returns, rather than joining what comes next."""
        if await self._send():
            await self._send()

    async def _send(self) -> bool:
        """One pipeline of every pending batch; True where Redis lacked the script (loaded since)."""
        sending = [(log, batch) for log in self._logs.values() for batch in log.batches]
        if not sending:
            return False
        waits = await self._waits([log.owner.task_id for log, _ in sending])
        appends: list[Append] = []
        async with self.redis.pipeline(transaction=False) as pipe:
            for log, batch in sending:
                # from here until its answer is settled the batch does not change: runs add to a new one
                batch.sent = True
                appends.append(batch.call(log.owner))
                self._store.add_to(pipe, appends[-1])
            for wait, target in waits:
                pipe.execute_command(*wait, **target)
            try:
                results = await pipe.execute(raise_on_error=False)
            except BaseException:
                for _, batch in sending:
                    batch.sent = False
                raise
        acknowledged = [results.pop() for _ in waits]
        self._note_replicas(all(map(self._replicas.confirmed, acknowledged)) if waits else not self._replicas.wanted,
                            acknowledged)
        missing = any(isinstance(result, NoScriptError) for result in results)
        if missing:
            await self._store.load_script()
        for (log, batch), append, result in zip(sending, appends, results, strict=True):
            self._settle(log, batch, result if isinstance(result, Exception) else reply_of(append, result))
        async with self._flushed:
            self._flushed.notify_all()
        failed = next((r for r in results if isinstance(r, Exception) and not isinstance(r, NoScriptError)), None)
        if failed is not None:
            raise failed  # READONLY (a demoted primary behind a plain URL), OOM, ...: back off, then retry
        return missing

    async def _waits(self, task_ids: list[str]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The WAITs that end the flush: one, or on a cluster one for each shard written to."""
        if isinstance(self.redis, cluster.ClusterClient):
            task_keys = [keys.task(task_id) for task_id in task_ids]
            waits = await self._replicas.cluster_waits(self.redis, task_keys)
            return [(wait, {"target_nodes": node}) for wait, node in waits]
        wait = await self._replicas.command(self.redis)
        return [] if wait is None else [(wait, {})]

    def _note_replicas(self, confirmed: bool, answers: list[object]) -> None:
        if not self._replicas.wanted:
            return
        short = not confirmed
        if short and not self._replicas_short:
            logger.warning("events are not reaching %d replica(s) (%s); storing them on the primary alone",
                           self._replicas.wanted, "none online" if not answers else
                           f"no answer within {self._replicas.timeout_ms} ms")
        elif self._replicas_short and not short:
            logger.info("events reach the replicas again")
        self._replicas_short = short

    def _settle(self, log: _Log, batch: _Pending, result: AppendReply | Exception) -> None:
        if self._logs.get(log.owner.task_id) is not log or batch not in log.batches:
            return
        if isinstance(result, Exception):
            if not isinstance(result, NoScriptError):
                logger.error("append to task %s failed: %s", log.owner.task_id, result)
            batch.sent = False
            self._dirty.set()
            return
        if not result.stored:
            if result.outcome is AppendOutcome.FENCED:
                logger.warning("task %s: lease lost; stopping", log.owner.task_id)
            else:
                logger.warning("task %s: the stored log (%s events, %s tokens) is not this run's; stopping",
                               log.owner.task_id, result.stored_events, result.stored_tokens)
            self.close(log.owner.task_id)
            log.owner.on_fenced()
            return
        log.batches.remove(batch)
        if batch.final is not None:
            self.close(log.owner.task_id)
            log.owner.on_final_durable()
        elif result.cancel_requested:
            log.owner.on_cancel_requested()

