"""The event log of a task: a Redis stream whose entry ids are ``0-<n>`` for event number n.

Explicit ids make appends idempotent: Redis rejects an id that is not above the last one, and the
append script also checks the number against the task record, so a retried step cannot write an
event twice. Readers replay with ``XRANGE`` and follow with ``XREAD BLOCK``. Event data is stored
as the JSON that goes on the wire, so the API relays it without decoding.
"""

from collections.abc import Sequence

import msgspec
from redis.asyncio import Redis

from lmsp_core import keys, wire

READ_CHUNK = 512


class Event(msgspec.Struct, frozen=True):
    id: int
    name: str
    data: bytes

    @property
    def final(self) -> bool:
        return self.name in wire.FINAL_EVENTS


def stream_id(number: int) -> str:
    return f"0-{number}"


def event_number(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.partition("-")[2])


def to_events(entries: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> list[Event]:
    return [Event(event_number(entry_id), fields[b"event"].decode(), fields[b"data"]) for entry_id, fields in entries]


async def read_after(redis: Redis, task_id: str, after: int, count: int = READ_CHUNK,
                     until: int | None = None) -> list[Event]:
    """Up to ``count`` events numbered above ``after`` (and at most ``until``)."""
    end = "+" if until is None else stream_id(until)
    entries = await redis.xrange(keys.events(task_id), min=f"({stream_id(after)}", max=end, count=count)
    return to_events(entries)


async def history_exists(redis: Redis, task_id: str) -> bool:
    return bool(await redis.exists(keys.events(task_id)))


async def last_event(redis: Redis, task_id: str) -> Event | None:
    entries = await redis.xrevrange(keys.events(task_id), count=1)
    return to_events(entries)[0] if entries else None
