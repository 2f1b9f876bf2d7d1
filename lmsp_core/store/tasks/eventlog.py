"""The event log of a task: a Redis stream whose entry ids are ``0-<n>`` for event number n.

Explicit ids make appends idempotent: Redis rejects an id that is not above the last one, and the
append script also checks the number against the task record, so a retried step cannot write an
event twice. Readers replay with ``XRANGE`` and follow with ``XREAD BLOCK``.

Entries are stored compactly (docs/performance.md): the event name as a one-letter code, and the
data as the JSON that goes on the wire minus its leading ``"response_id"`` member, which every event
of a task repeats. Reading puts the member back with one concatenation, without decoding the JSON,
so the API still relays stored bytes. This halves Redis memory per text delta.
"""

from collections.abc import Sequence

import msgspec
from redis.asyncio import Redis

from lmsp_core import wire
from lmsp_core.store import keys
from lmsp_core.store.scripts import CODES

READ_CHUNK = 512
# the sequence part of a stream entry id is an unsigned 64-bit integer: no event number, so no
# cursor, can be larger (Redis refuses such an id in XRANGE / XREAD)
MAX_EVENT_ID = 2**64 - 1

NAMES = {code: name for name, code in CODES.items()}


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


def _shared_prefix(response_id: str) -> bytes:
    return b'{"response_id":"' + response_id.encode() + b'"'


def pack(name: str, data: bytes, response_id: str) -> tuple[str, bytes]:
    """The stored form of an event: its code, and its data without the leading response id."""
    prefix = _shared_prefix(response_id)
    return CODES.get(name, name), data[len(prefix):] if data.startswith(prefix) else data


def unpack(stored_name: bytes, stored_data: bytes, response_id: str) -> tuple[str, bytes]:
    name = stored_name.decode()
    # packed data starts with the "," or "}" that followed the response id; whole JSON with "{"
    data = stored_data if stored_data.startswith(b"{") else _shared_prefix(response_id) + stored_data
    return NAMES.get(name, name), data


def to_events(entries: Sequence[tuple[bytes, dict[bytes, bytes]]], response_id: str) -> list[Event]:
    events = []
    for entry_id, fields in entries:
        name, data = unpack(fields[b"event"], fields[b"data"], response_id)
        events.append(Event(event_number(entry_id), name, data))
    return events


async def read_after(redis: Redis, task_id: str, response_id: str, after: int, count: int = READ_CHUNK,
                     until: int | None = None) -> list[Event]:
    """Up to ``count`` events numbered above ``after`` (and at most ``until``)."""
    end = "+" if until is None else stream_id(until)
    entries = await redis.xrange(keys.events(task_id), min=f"({stream_id(after)}", max=end, count=count)
    return to_events(entries, response_id)


async def history_exists(redis: Redis, task_id: str) -> bool:
    return bool(await redis.exists(keys.events(task_id)))


async def last_event(redis: Redis, task_id: str, response_id: str) -> Event | None:
    entries = await redis.xrevrange(keys.events(task_id), count=1)
    return to_events(entries, response_id)[0] if entries else None
