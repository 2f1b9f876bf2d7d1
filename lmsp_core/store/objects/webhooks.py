"""Webhook endpoints and their deliveries, in Redis (docs/protocol.md, "Webhooks"). No HTTP here:
the API's sender (``api/background/webhooks``) takes the deliveries that are due and records each attempt.

An endpoint belongs to a principal: a URL, the event types it subscribes to, and its signing secret,
stored as it is (it signs every delivery) but shown only when the endpoint is created, never
listed or logged. ``emit`` turns an event into one delivery per endpoint of the principal that
subscribes to its type, once per (endpoint, event id): the delivery's id derives from both, and a
delivery that exists is left as it is, so that whoever announces an event may announce it again.
A delivery keeps the body it was created with (every attempt sends the same bytes under the same
``webhook-id``: the event id), its status and its attempts, and waits in the due index (server
time) for its next attempt. Deliveries are kept ``RETENTION`` after their last attempt, the newest
``CAP`` per endpoint.
"""

import base64
import secrets
import time
from collections.abc import Mapping

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from lmsp_core.store import keys, scripts
from lmsp_core.store.connections import ReplicaWatch, replicated
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest, LimitExceeded
from lmsp_core.wire.webhooks import (
    DELIVERY_ID,
    SECRET_PREFIX,
    TEST_EVENT,
    WEBHOOK_ID,
    DeliveryStatus,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEndpointWithSecret,
    WebhookEvent,
)

RETENTION = 7 * 86400.0  # seconds a delivery is kept after its last attempt
CAP = 1000  # deliveries kept per endpoint; the oldest go first, delivered or not
MAX_ENDPOINTS = 32  # per principal: each event reads them all
SECRET_BYTES = 32

_NOW_MS = "local t = redis.call('TIME') local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# KEYS: delivery, the endpoint's deliveries, due.  ARGV: id, endpoint, event id, type, body, retention_ms,
# trace ('' for none). Creates a pending delivery due now, unless it exists. Returns {created (0|1), the
# endpoint's count}.
_CREATE = _NOW_MS + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, 0} end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'endpoint', ARGV[2], 'event_id', ARGV[3], 'type', ARGV[4],
           'body', ARGV[5], 'status', 'pending', 'attempts', 0, 'created_ms', now_ms, 'next_ms', now_ms)
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'trace', ARGV[7]) end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[2], now_ms, ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[3], now_ms, ARGV[1])
return {1, redis.call('ZCARD', KEYS[2])}
"""

# KEYS: delivery, due.  ARGV: the attempts it had when taken, the attempt (JSON), delivered (1|0),
# the retry delays (ms, comma-separated), retention_ms.
# Records an attempt, unless another sender recorded one since (then 'stale'), and moves the delivery
# on: 'delivered', 'failed' (no retry left) or 'pending' (due again after the next delay).
_RECORD = _NOW_MS + """
local held = redis.call('HMGET', KEYS[1], 'status', 'attempts', 'log', 'id')
if held[1] ~= 'pending' or tonumber(held[2]) ~= tonumber(ARGV[1]) then return 'stale' end
local n = tonumber(held[2]) + 1
redis.call('HSET', KEYS[1], 'attempts', n, 'log', (held[3] or '') .. ARGV[2] .. '\\n')
redis.call('PEXPIRE', KEYS[1], ARGV[5])
local delays = {}
for delay in string.gmatch(ARGV[4], '[^,]+') do table.insert(delays, tonumber(delay)) end
if ARGV[3] == '1' or n > #delays then
  local status = 'failed'
  if ARGV[3] == '1' then status = 'delivered' end
  redis.call('HSET', KEYS[1], 'status', status)
  redis.call('HDEL', KEYS[1], 'next_ms')
  redis.call('ZREM', KEYS[2], held[4])
  return status
end
local next_ms = now_ms + delays[n]
redis.call('HSET', KEYS[1], 'next_ms', next_ms)
redis.call('ZADD', KEYS[2], next_ms, held[4])
return 'pending'
"""


class EndpointRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    owner: str
    url: str
    events: list[str]
    secret: str  # whsec_ + base64 of SECRET_BYTES random bytes (Standard Webhooks)
    created_at: float

    def to_wire(self) -> WebhookEndpoint:
        return WebhookEndpoint(id=self.id, url=self.url, events=self.events, created_at=int(self.created_at))

    def with_secret(self) -> WebhookEndpointWithSecret:
        return WebhookEndpointWithSecret(id=self.id, url=self.url, events=self.events,
                                         created_at=int(self.created_at), secret=self.secret)


class DeliveryRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    endpoint: str
    event_id: str
    event_type: str
    body: bytes  # the event as first encoded: what every attempt sends and signs
    status: DeliveryStatus
    attempts: int
    created_ms: int
    next_ms: int | None
    log: list[WebhookAttempt]
    trace: str | None = None  # the W3C traceparent of what it reports (a task's, a batch's)

    def to_wire(self) -> WebhookDelivery:
        next_at = None if self.next_ms is None or self.status != "pending" else -(-self.next_ms // 1000)
        return WebhookDelivery(id=self.id, endpoint_id=self.endpoint, event_id=self.event_id,
                               event_type=self.event_type, status=self.status, created_at=self.created_ms // 1000,
                               next_attempt_at=next_at, attempts=self.log)


def _delivery(raw: Mapping[bytes, bytes]) -> DeliveryRecord:
    fields = {key.decode(): value for key, value in raw.items()}
    log = [msgspec.json.decode(line, type=WebhookAttempt) for line in fields.get("log", b"").splitlines() if line]
    return DeliveryRecord(
        id=fields["id"].decode(), endpoint=fields["endpoint"].decode(), event_id=fields["event_id"].decode(),
        event_type=fields["type"].decode(), body=fields["body"], status=fields["status"].decode(),  # type: ignore[arg-type]
        attempts=int(fields["attempts"]), created_ms=int(fields["created_ms"]),
        next_ms=int(fields["next_ms"]) if "next_ms" in fields else None, log=log,
        trace=fields["trace"].decode() if "trace" in fields else None)


# --- endpoints -------------------------------------------------------------------------------------


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


async def create_endpoint(redis: Redis, owner: str, url: str, events: list[str], *,
                          replicas: ReplicaWatch | None = None) -> EndpointRecord:
    """A new endpoint of ``owner`` for a URL and event types that ``lmsp_core.requests.webhooks``
    checked; its record carries the secret, to be shown once. With ``replicas``, it returns once
    the replicas hold it too (or the wait timed out)."""
    record = EndpointRecord(id=ids.new_id(WEBHOOK_ID), owner=owner, url=url, events=events, secret=new_secret(),
                            created_at=time.time())
    if await redis.zcard(keys.owner_webhooks(owner)) >= MAX_ENDPOINTS:
        raise LimitExceeded(f"Principal {owner!r} already has {MAX_ENDPOINTS} webhook endpoints; delete one first.",
                            code="too_many_webhooks")
    created_ms = int(record.created_at * 1000)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(keys.webhook(record.id), msgspec.json.encode(record))
        pipe.zadd(keys.owner_webhooks(owner), {record.id: created_ms})
        pipe.zadd(keys.all_webhooks(), {record.id: created_ms})
        await pipe.execute()
    if replicas is not None:
        await replicated(redis, replicas, keys.all_webhooks())
    return record


async def get_endpoint(redis: Redis, endpoint_id: str, owner: str | None = None) -> EndpointRecord | None:
    """The endpoint (of ``owner``, when one is given), or None."""
    raw = await redis.get(keys.webhook(endpoint_id)) if ids.is_id(endpoint_id, WEBHOOK_ID) else None
    if raw is None:
        return None
    record = msgspec.json.decode(raw, type=EndpointRecord)
    return record if owner is None or record.owner == owner else None


async def list_endpoints(redis: Redis, owner: str | None = None) -> list[EndpointRecord]:
    """A principal's endpoints (every endpoint without ``owner``), oldest first."""
    index = keys.all_webhooks() if owner is None else keys.owner_webhooks(owner)
    found: list[bytes] = await redis.zrange(index, 0, -1)
    if not found:
        return []
    raws = await redis.mget([keys.webhook(endpoint_id.decode()) for endpoint_id in found])
    return [msgspec.json.decode(raw, type=EndpointRecord) for raw in raws if raw is not None]


async def delete_endpoint(redis: Redis, endpoint_id: str, owner: str | None = None, *,
                          replicas: ReplicaWatch | None = None) -> bool:
    """Delete an endpoint and its deliveries (pending ones are never sent); False if there is none.
    With ``replicas``, it returns once the replicas hold the deletion too (or the wait timed out)."""
    record = await get_endpoint(redis, endpoint_id, owner)
    if record is None:
        return False
    listed = [raw.decode() for raw in await redis.zrange(keys.webhook_deliveries(record.id), 0, -1)]
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.webhook(record.id), keys.webhook_deliveries(record.id))
        pipe.zrem(keys.owner_webhooks(record.owner), record.id)
        pipe.zrem(keys.all_webhooks(), record.id)
        _forget(pipe, listed)
        await pipe.execute()
    if replicas is not None:
        await replicated(redis, replicas, keys.all_webhooks())
    return True


def _forget(pipe: Pipeline, delivery_ids: list[str]) -> None:
    for start in range(0, len(delivery_ids), 500):
        chunk = delivery_ids[start:start + 500]
        pipe.delete(*(keys.delivery(delivery_id) for delivery_id in chunk))
        pipe.zrem(keys.deliveries_due(), *chunk)


# --- events and deliveries -----------------------------------------------------------------------


async def emit(redis: Redis, principal: str, event_type: str, data: Mapping[str, str], event_id: str, *,
               created_at: float | None = None, trace: str | None = None) -> int:
    """Queue the event for each endpoint of ``principal`` that subscribes to ``event_type``, once per
    endpoint and ``event_id`` (a repeat creates nothing); returns the deliveries created.
    ``created_at``: when what it reports happened (default: now); ``trace``: its trace context (a
    ``traceparent``), which every attempt sends."""
    endpoints = [endpoint for endpoint in await list_endpoints(redis, principal) if event_type in endpoint.events]
    if not endpoints:
        return 0
    event = WebhookEvent(id=event_id, type=event_type, created_at=int(created_at or time.time()), data=dict(data))
    created = [await _deliver(redis, endpoint.id, event, trace) for endpoint in endpoints]
    return sum(delivery is not None for delivery in created)


async def send_test(redis: Redis, endpoint: EndpointRecord) -> str:
    """Queue a ``webhook.test`` event for the endpoint; returns its delivery's id."""
    event = WebhookEvent(id=ids.new_id("evt"), type=TEST_EVENT, created_at=int(time.time()),
                         data={"id": endpoint.id})
    delivery_id = await _deliver(redis, endpoint.id, event)
    assert delivery_id is not None  # a new event id: never a repeat
    return delivery_id


def delivery_id(endpoint_id: str, event_id: str) -> str:
    """The one delivery of an event to an endpoint."""
    return ids.derived_id(DELIVERY_ID, f"{endpoint_id}\n{event_id}")


async def _deliver(redis: Redis, endpoint_id: str, event: WebhookEvent, trace: str | None = None) -> str | None:
    """The new delivery's id, or None when the endpoint had this event already."""
    created_id = delivery_id(endpoint_id, event.id)
    script = redis.register_script(_CREATE)
    created, count = await script(
        keys=[keys.delivery(created_id), keys.webhook_deliveries(endpoint_id), keys.deliveries_due()],
        args=[created_id, endpoint_id, event.id, event.type, msgspec.json.encode(event), int(RETENTION * 1000),
              trace or ""])
    if int(count) > CAP:
        await _trim(redis, endpoint_id)
    return created_id if int(created) else None


async def _trim(redis: Redis, endpoint_id: str) -> None:
    index = keys.webhook_deliveries(endpoint_id)
    oldest = [raw.decode() for raw in await redis.zrange(index, 0, -CAP - 1)]
    if oldest:
        async with redis.pipeline(transaction=True) as pipe:
            _forget(pipe, oldest)
            pipe.zrem(index, *oldest)
            await pipe.execute()


async def get_delivery(redis: Redis, delivery_id: str) -> DeliveryRecord | None:
    raw = await redis.hgetall(keys.delivery(delivery_id))  # type: ignore[misc]
    return _delivery(raw) if raw else None


async def list_deliveries(redis: Redis, endpoint_id: str, limit: int,
                          after: str | None = None) -> tuple[list[DeliveryRecord], bool]:
    """An endpoint's deliveries, newest first, after the delivery ``after`` (``400 invalid_cursor``
    when it is no longer listed); and whether more follow."""
    index = keys.webhook_deliveries(endpoint_id)
    start = 0
    if after:
        rank = await redis.zrevrank(index, after)
        if rank is None:
            raise InvalidRequest(f"Listing cursor {after[:100]!r} is not a delivery of this endpoint (any longer).",
                                 code="invalid_cursor")
        start = rank + 1
    listed = [raw.decode() for raw in await redis.zrevrange(index, start, start + limit)]
    async with redis.pipeline(transaction=False) as pipe:
        for listed_id in listed[:limit]:
            pipe.hgetall(keys.delivery(listed_id))
        raws = await pipe.execute()
    gone = [listed_id for listed_id, raw in zip(listed, raws, strict=False) if not raw]
    if gone:  # expired: they leave the list
        await redis.zrem(index, *gone)
    return [_delivery(raw) for raw in raws if raw], len(listed) > limit


async def take_due(redis: Redis, limit: int, hold: float) -> list[str]:
    """Up to ``limit`` deliveries due now, each held ``hold`` seconds from other senders."""
    script = redis.register_script(scripts.INDEX_TAKE)
    reply = await script(keys=[keys.deliveries_due()], args=[limit, int(hold * 1000)])
    return [raw.decode() for raw in reply[1:]]


async def drop_due(redis: Redis, delivery_id: str) -> None:
    """A delivery that is gone (expired, or its endpoint deleted) leaves the due index."""
    await redis.zrem(keys.deliveries_due(), delivery_id)


async def record_attempt(redis: Redis, delivery: DeliveryRecord, attempt: WebhookAttempt, delays: list[float]) -> str:
    """Record an attempt of ``delivery`` (as it was taken); returns its status now: ``delivered``,
    ``failed`` (no retry left), ``pending`` (due again after the next of ``delays``) or ``stale``
    (another sender recorded an attempt meanwhile; this one is not recorded)."""
    script = redis.register_script(_RECORD)
    status = await script(
        keys=[keys.delivery(delivery.id), keys.deliveries_due()],
        args=[delivery.attempts, msgspec.json.encode(attempt), int(attempt.error is None),
              ",".join(str(int(delay * 1000)) for delay in delays) or "", int(RETENTION * 1000)])
    return str(status.decode())
