"""Helpers of the failover tests (Sentinel: ``test_failover.py``; Redis Cluster:
``test_rediscluster.py``): eight tasks, each with a follower on the API it was not created on, while
a Redis node is killed; then the checks of docs/reliability.md on every follower and task."""

import asyncio
import contextlib
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from lmsp_core import wire
from tests.faults import Group, assert_exactly_once, text_of
from tests.support import Api, SseEvent, Worker, body, sse_events, wait_for

if TYPE_CHECKING:
    from tests.faults import AnyRedis

MODEL = "tiny-random"
TASKS = 8
TOKENS = 1000  # long enough that no task ends before every follower has seen a few events
SEEN_BEFORE_KILL = 5  # events every follower has when the node is killed


# a long lease: a slow failover must not cost a task its lease (no task is to be taken over); a
# WAIT timeout longer than the test's lag of the replica (the default is 0.1 s)
WAIT_TIMEOUT = 3.0
SETTINGS = {"lease_ttl": 30, "sse_heartbeat": 1, "redis_wait_timeout": WAIT_TIMEOUT}


class Victim(Protocol):
    """The Redis node a test kills."""

    def stop(self, sig: int = signal.SIGTERM) -> None: ...


@contextlib.asynccontextmanager
async def serving(redis: "AnyRedis") -> AsyncIterator[Group]:
    """Two API processes and two workers on ``redis`` (started; cleaned up on the way out), which
    know only what its settings say (sentinels, or some cluster nodes)."""
    url, where = redis.settings["redis_url"], {k: v for k, v in redis.settings.items() if k != "redis_url"}
    group = await Group.start(redis, [Api(url, **where, **SETTINGS) for _ in range(2)],
                              [Worker(url, [MODEL], **where, **SETTINGS) for _ in range(2)])
    try:
        yield group
    finally:
        await group.close()


def request(slot: int) -> dict[str, Any]:
    return body(MODEL, f"Story {slot}: tell me what happened next", max_output_tokens=TOKENS)


@dataclass
class Follower:
    """A client following one task: every event it received, in order, repeats included."""

    task_id: str
    events: list[SseEvent] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    interruptions: list[str] = field(default_factory=list)  # why it had to reconnect

    @property
    def last_id(self) -> int:
        return (self.events[-1].id or 0) if self.events else 0

    async def run(self, clients: list[httpx.AsyncClient], turn: int) -> None:
        """Follow to the final event, reconnecting to the API processes in turn, with Last-Event-ID."""
        while True:
            headers = {"Last-Event-ID": str(self.last_id)} if self.events else {}
            try:
                async for event in sse_events(clients[turn % len(clients)], "GET",
                                              f"/lmsp/v1/tasks/{self.task_id}/events", headers=headers):
                    if event.event == wire.ERROR:
                        self.interruptions.append(event.data["error"]["code"])
                        break
                    if event.id is None:
                        continue  # a queue notice, not part of the log
                    self.events.append(event)
                    self.arrivals.append(time.monotonic())
                    if event.event in wire.FINAL_EVENTS:
                        return
                else:
                    self.interruptions.append("stream ended")
            except httpx.HTTPStatusError as exc:
                self.interruptions.append(f"HTTP {exc.response.status_code}")
            except httpx.TransportError as exc:
                self.interruptions.append(type(exc).__name__)
            turn += 1
            await asyncio.sleep(0.1)

    def first_new_event(self, killed_at: float, last_before: int) -> float | None:
        """Seconds from the kill to the first event past what this follower had then."""
        for event, arrived in zip(self.events, self.arrivals, strict=True):
            if arrived > killed_at and (event.id or 0) > last_before:
                return arrived - killed_at
        return None


@dataclass
class Outcome:
    followers: list[Follower]
    killed_at: float
    seen_at_kill: list[int]

    def first_new_events(self) -> list[float]:
        found = [f.first_new_event(self.killed_at, seen) for f, seen in zip(self.followers, self.seen_at_kill,
                                                                              strict=True)]
        return [seconds for seconds in found if seconds is not None]


Hook = Callable[[list[Follower]], Awaitable[Any]]


async def generate_through(group: Group, victim: Victim, before_kill: Hook | None = None,
                           after_kill: Hook | None = None) -> Outcome:
    """Create the tasks (alternating between the APIs), follow each on the other API, and SIGKILL
    ``victim`` once every follower has a few events; return when every follower has its final event."""
    async with httpx.AsyncClient(base_url=group.apis[0].url, timeout=60) as a, \
            httpx.AsyncClient(base_url=group.apis[1].url, timeout=60) as b:
        clients = [a, b]
        ids = [await group.create(request(i), clients[i % 2]) for i in range(TASKS)]
        followers = [Follower(task_id) for task_id in ids]
        runs = [asyncio.create_task(f.run(clients, i + 1)) for i, f in enumerate(followers)]
        try:
            await wait_for(lambda: _all_have(followers, SEEN_BEFORE_KILL), timeout=120,
                           what=f"{SEEN_BEFORE_KILL} events for every follower")
            if before_kill is not None:
                await before_kill(followers)
            seen_at_kill = [f.last_id for f in followers]
            assert not any(f.events[-1].event in wire.FINAL_EVENTS for f in followers), "killed too late"
            victim.stop(signal.SIGKILL)
            killed_at = time.monotonic()
            if after_kill is not None:
                await after_kill(followers)
            await asyncio.wait_for(asyncio.gather(*runs), 180)
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    return Outcome(followers, killed_at, seen_at_kill)


async def _all_have(followers: list[Follower], count: int) -> bool:
    return all(len(f.events) >= count for f in followers)


async def check(group: Group, outcome: Outcome, references: list[str]) -> dict[str, Any]:
    """The promises of docs/reliability.md for every follower and task; returns the figures."""
    twice: list[int] = []
    lost: list[int] = []
    replaced: list[int] = []
    for follower, reference in zip(outcome.followers, references, strict=True):
        stored = await group.log(follower.task_id)
        counts = Counter(e.id for e in follower.events)
        twice += [event_id for event_id, count in counts.items() if count > 1]
        lost += [e.id or 0 for e in stored if e.id not in counts]
        replaced += [seen.id or 0 for seen in follower.events
                     if any(e.id == seen.id and e != seen for e in stored)]
        assert_exactly_once(stored)
        assert_exactly_once(follower.events)
        assert follower.events == stored, follower.task_id
        assert text_of(stored) == reference, follower.task_id
        assert await group.attempts(follower.task_id) == 1, follower.task_id  # never taken over
    new = outcome.first_new_events()
    assert len(new) == TASKS
    assert not twice and not lost and not replaced
    return {"first new event (s)": round(min(new), 2), "every follower (s)": round(max(new), 2),
            "interrupted": dict(Counter(reason for f in outcome.followers for reason in f.interruptions)),
            "seen twice": twice, "lost": lost, "replaced": replaced}


async def new_requests_succeed(group: Group, apis: list[Api]) -> None:
    for api in apis:
        async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
            assert_exactly_once(await group.log(await group.create(body(MODEL, "After", max_output_tokens=5), client),
                                                client=client))
