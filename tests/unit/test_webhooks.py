"""Webhooks without a server process: the signature against the official SDK's verifier, the address
check against SSRF, the store (deliveries once per event, the retry schedule, listing, deleting), the
events of a task's end, the stream that announces it, and one attempt against a receiver in a thread."""

import asyncio
import ipaddress
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import openai
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from api.background.webhooks import signing, targets
from api.background.webhooks.consumer import FinishedConsumer, TaskEnd, task_end, task_events
from api.background.webhooks.sender import Sender
from lmsp_core import wire
from lmsp_core.requests import webhooks as checks
from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.objects import webhooks
from lmsp_core.store.tasks.records import TaskRecord, TaskStore
from lmsp_core.wire import ids
from lmsp_core.wire.errors import InvalidRequest
from lmsp_core.wire.webhooks import WebhookAttempt, WebhookEvent
from tests.support import Receiver, RedisServer, user_input

VERIFIER = openai.OpenAI(api_key="unused").webhooks
# the session's API processes send whatever deliveries are due in their database: these tests keep
# theirs in another one, which no process reads
DATABASE = 7


@pytest_asyncio.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_server.url.rpartition("/")[0] + f"/{DATABASE}")
    yield connection
    await connection.aclose()


def principal() -> str:
    return f"hooks-{uuid.uuid4().hex[:10]}"


# --- signing ---------------------------------------------------------------------------------------


def test_the_sdk_verifies_a_signed_event() -> None:
    secret = webhooks.new_secret()
    assert secret.startswith("whsec_") and len(signing.key(secret)) == webhooks.SECRET_BYTES
    event = wire_event("response.completed", {"id": "resp_1"})
    headers = signing.headers(secret, "evt_1", event)
    unwrapped = VERIFIER.unwrap(event, headers, secret=secret)
    assert unwrapped.type == "response.completed" and unwrapped.data.id == "resp_1"
    VERIFIER.unwrap(event.decode(), headers, secret=secret)  # as text too
    for tampered in (event.replace(b"resp_1", b"resp_2"), event + b" "):
        with pytest.raises(openai.InvalidWebhookSignatureError):
            VERIFIER.unwrap(tampered, headers, secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        VERIFIER.unwrap(event, headers, secret=webhooks.new_secret())
    with pytest.raises(openai.InvalidWebhookSignatureError):  # signed for another event id
        VERIFIER.unwrap(event, {**headers, "webhook-id": "evt_2"}, secret=secret)
    stale = signing.headers(secret, "evt_1", event, timestamp=int(time.time()) - 600)
    with pytest.raises(openai.InvalidWebhookSignatureError):  # beyond the SDK's five minutes
        VERIFIER.unwrap(event, stale, secret=secret)


def wire_event(event_type: str, data: dict[str, str]) -> bytes:
    return msgspec.json.encode(WebhookEvent(id="evt_1", type=event_type, created_at=1, data=data))


# --- the address check -------------------------------------------------------------------------------

REFUSED = {
    "loopback": ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"],
    "private": ["10.0.0.1", "172.16.5.4", "192.168.1.1", "fc00::1", "fd12:3456::1", "64:ff9b::a00:1"],
    "link-local": ["169.254.169.254", "fe80::1"],
    "unspecified": ["0.0.0.0", "::"],
    "multicast": ["224.0.0.1", "239.1.2.3", "ff02::1", "ff0e::1"],
    "non-global": ["100.64.0.1"],  # shared address space (carrier-grade NAT)
}


@pytest.mark.parametrize(("kind", "address"), [(kind, a) for kind, found in REFUSED.items() for a in found])
def test_addresses_that_are_not_global_are_refused(kind: str, address: str) -> None:
    assert targets.refusal(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.215.14", "2606:4700::1111"])
def test_global_addresses_are_allowed(address: str) -> None:
    assert targets.refusal(ipaddress.ip_address(address)) is None


async def test_a_target_is_resolved_and_checked() -> None:
    with pytest.raises(targets.TargetRefused) as refused:
        await targets.resolve("http://localhost:9/hook", allow_private=False)
    assert refused.value.code == "webhook_url_not_allowed" and "loopback" in refused.value.detail
    with pytest.raises(targets.TargetRefused):
        await targets.resolve("https://[::ffff:10.1.2.3]/hook", allow_private=False)
    allowed = await targets.resolve("http://localhost:9/hook", allow_private=True)
    assert allowed.address.is_loopback and allowed.hostname == "localhost"
    public = await targets.resolve("https://8.8.8.8/hook", allow_private=False)
    assert public.address == ipaddress.ip_address("8.8.8.8")
    with pytest.raises(targets.TargetUnresolved) as unresolved:
        await targets.resolve("https://receiver.invalid/hook", allow_private=False)
    assert unresolved.value.code == "webhook_url_unresolved"


@pytest.mark.parametrize("url", ["ftp://example.org/x", "example.org/x", "http:///x", "http://user:pw@example.org/",
                                 "http://example.org/#frag", "http://exa mple.org/", "http://example.org:0/",
                                 "http://example.org:99999/", "https://bücher.example/",
                                 "https://example.org/caf\u00e9", "http://" + "a" * 2050])
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        checks.check_url(url)
    assert refused.value.code == "invalid_webhook_url"


def test_event_types_are_checked() -> None:
    assert checks.check_events(["task.failed", "batch.completed", "task.failed"]) == ["task.failed",
                                                                                         "batch.completed"]
    for unknown in ("response.done", "webhook.test", ""):
        with pytest.raises(InvalidRequest) as refused:
            checks.check_events(["task.failed", unknown])
        assert refused.value.code == "unknown_event_type"


# --- the store -------------------------------------------------------------------------------------


async def test_an_event_makes_one_delivery_per_subscribed_endpoint(redis: aioredis.Redis) -> None:
    owner = principal()
    both = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["batch.completed", "task.failed"])
    batches = await webhooks.create_endpoint(redis, owner, "https://b.example/hook", ["batch.completed"])
    await webhooks.create_endpoint(redis, owner, "https://c.example/hook", ["task.completed"])
    await webhooks.create_endpoint(redis, principal(), "https://d.example/hook", ["batch.completed"])  # another owner

    assert await webhooks.emit(redis, owner, "batch.completed", {"id": "batch_1"}, "evt_batch_1_completed") == 2
    # announced again (a driver retried, a consumer died before its acknowledgement): nothing new
    assert await webhooks.emit(redis, owner, "batch.completed", {"id": "batch_1"}, "evt_batch_1_completed") == 0
    assert await webhooks.emit(redis, owner, "task.failed", {"id": "task_1"}, "evt_task_1_task_failed") == 1
    assert await webhooks.emit(redis, owner, "response.completed", {"id": "resp_1"}, "evt_x") == 0

    for endpoint, count in ((both, 2), (batches, 1)):
        found, more = await webhooks.list_deliveries(redis, endpoint.id, 10)
        assert len(found) == count and not more
    delivery = (await webhooks.list_deliveries(redis, batches.id, 10))[0][0]
    assert delivery.id == webhooks.delivery_id(batches.id, "evt_batch_1_completed")
    assert delivery.status == "pending" and delivery.attempts == 0 and delivery.log == []
    event = msgspec.json.decode(delivery.body)
    assert event["id"] == "evt_batch_1_completed" and event["object"] == "event"
    assert event["type"] == "batch.completed" and event["data"] == {"id": "batch_1"}
    assert await redis.zscore(keys.deliveries_due(), delivery.id) is not None


async def test_the_secret_is_kept_but_never_listed(redis: aioredis.Redis) -> None:
    owner = principal()
    record = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.completed"])
    assert record.with_secret().secret == record.secret
    listed = [endpoint.to_wire() for endpoint in await webhooks.list_endpoints(redis, owner)]
    assert [endpoint.id for endpoint in listed] == [record.id]
    assert record.secret not in msgspec.json.encode(listed).decode()
    assert (await webhooks.get_endpoint(redis, record.id, owner)) == record
    assert await webhooks.get_endpoint(redis, record.id, "someone-else") is None
    assert await webhooks.get_endpoint(redis, "wh_nonsense") is None


async def test_a_failed_attempt_is_retried_on_schedule_then_given_up(redis: aioredis.Redis) -> None:
    owner = principal()
    endpoint = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.failed"])
    await webhooks.emit(redis, owner, "task.failed", {"id": "t"}, "evt_sched")
    delivery = await webhooks.get_delivery(redis, webhooks.delivery_id(endpoint.id, "evt_sched"))
    assert delivery is not None
    delays = [60.0, 120.0]
    failed = WebhookAttempt(attempted_at=time.time(), duration_ms=3, status_code=500, error="the receiver answered 500")

    before = await server_ms(redis)
    assert await webhooks.record_attempt(redis, delivery, failed, delays) == "pending"
    due = await redis.zscore(keys.deliveries_due(), delivery.id)
    assert before + 60_000 <= due <= await server_ms(redis) + 60_000
    # a sender that took it before this attempt was recorded records nothing
    assert await webhooks.record_attempt(redis, delivery, failed, delays) == "stale"

    delivery = await webhooks.get_delivery(redis, delivery.id)
    assert delivery is not None and delivery.attempts == 1 and delivery.log == [failed]
    assert delivery.to_wire().next_attempt_at == -(-int(due) // 1000)
    assert await webhooks.record_attempt(redis, delivery, failed, delays) == "pending"
    delivery = await webhooks.get_delivery(redis, delivery.id)
    assert delivery is not None
    assert await webhooks.record_attempt(redis, delivery, failed, delays) == "failed"  # no retry left
    delivery = await webhooks.get_delivery(redis, delivery.id)
    assert delivery is not None and delivery.status == "failed" and len(delivery.log) == 3
    assert delivery.to_wire().next_attempt_at is None
    assert await redis.zscore(keys.deliveries_due(), delivery.id) is None


async def test_a_delivered_event_leaves_the_due_index(redis: aioredis.Redis) -> None:
    owner = principal()
    endpoint = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.failed"])
    await webhooks.emit(redis, owner, "task.failed", {"id": "t"}, "evt_ok")
    delivery = await webhooks.get_delivery(redis, webhooks.delivery_id(endpoint.id, "evt_ok"))
    assert delivery is not None
    ok = WebhookAttempt(attempted_at=time.time(), duration_ms=3, status_code=204, error=None)
    assert await webhooks.record_attempt(redis, delivery, ok, [5.0]) == "delivered"
    assert await redis.zscore(keys.deliveries_due(), delivery.id) is None
    stored = await webhooks.get_delivery(redis, delivery.id)
    assert stored is not None and stored.status == "delivered" and stored.to_wire().attempts == [ok]


async def test_due_deliveries_are_held_while_taken(redis: aioredis.Redis) -> None:
    owner = principal()
    endpoint = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.failed"])
    sent = await webhooks.send_test(redis, endpoint)
    taken = await webhooks.take_due(redis, 1000, hold=60)
    assert sent in taken
    assert sent not in await webhooks.take_due(redis, 1000, hold=60)  # held from other senders


async def test_deliveries_are_listed_newest_first_in_pages(redis: aioredis.Redis) -> None:
    owner = principal()
    endpoint = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.completed"])
    made = []
    for _ in range(5):
        made.append(await webhooks.send_test(redis, endpoint))
        await asyncio.sleep(0.002)  # distinct creation times
    first, more = await webhooks.list_deliveries(redis, endpoint.id, 2)
    assert more and [d.id for d in first] == made[:-3:-1]
    second, more = await webhooks.list_deliveries(redis, endpoint.id, 2, first[-1].id)
    assert more and [d.id for d in second] == made[2:0:-1]
    last, more = await webhooks.list_deliveries(redis, endpoint.id, 2, second[-1].id)
    assert not more and [d.id for d in last] == made[:1]
    assert all(d.event_type == "webhook.test" for d in first + second + last)
    with pytest.raises(InvalidRequest) as refused:
        await webhooks.list_deliveries(redis, endpoint.id, 2, "dlv_01J8M6Q4W5C8H2K9P3S7Y1A6ZE")
    assert refused.value.code == "invalid_cursor"


async def test_deliveries_are_capped_per_endpoint(redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhooks, "CAP", 3)
    owner = principal()
    endpoint = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.completed"])
    made = []
    for _ in range(5):
        made.append(await webhooks.send_test(redis, endpoint))
        await asyncio.sleep(0.002)  # distinct creation times: the oldest go
    kept, _ = await webhooks.list_deliveries(redis, endpoint.id, 10)
    assert {d.id for d in kept} == set(made[2:])
    for dropped in made[:2]:
        assert await webhooks.get_delivery(redis, dropped) is None
        assert await redis.zscore(keys.deliveries_due(), dropped) is None


async def test_deleting_an_endpoint_drops_its_deliveries(redis: aioredis.Redis) -> None:
    owner = principal()
    endpoint = await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.completed"])
    sent = await webhooks.send_test(redis, endpoint)
    assert not await webhooks.delete_endpoint(redis, endpoint.id, "someone-else")
    assert await webhooks.delete_endpoint(redis, endpoint.id, owner)
    assert not await webhooks.delete_endpoint(redis, endpoint.id)
    assert await webhooks.list_endpoints(redis, owner) == []
    assert await webhooks.get_delivery(redis, sent) is None
    assert await redis.zscore(keys.deliveries_due(), sent) is None


async def test_a_principal_has_a_limited_number_of_endpoints(redis: aioredis.Redis,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhooks, "MAX_ENDPOINTS", 2)
    owner = principal()
    for _ in range(2):
        await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.completed"])
    with pytest.raises(InvalidRequest) as refused:
        await webhooks.create_endpoint(redis, owner, "https://a.example/hook", ["task.completed"])
    assert refused.value.code == "too_many_webhooks"


# --- a task's end ----------------------------------------------------------------------------------


def record(**fields: object) -> TaskRecord:
    base = TaskRecord(id=ids.new_id(ids.TASK), model="unit-hooks", owner=principal(), kind="task", status="completed",
                      created_at=time.time(), response_id=ids.new_id(ids.RESPONSE), request=b"{}",
                      finished_at=time.time())
    return msgspec.structs.replace(base, **fields)


def test_the_events_of_a_task_end() -> None:
    task = TaskEnd(id="task_1", owner="o", kind="task", status="incomplete", response_id="resp_1")
    assert task_events(task) == [("task.incomplete", {"id": "task_1", "response_id": "resp_1"},
                                  "evt_task_1_task_incomplete")]
    stored = task._replace(stored=True)
    assert [event[0] for event in task_events(stored)] == ["response.incomplete", "task.incomplete"]
    assert task_events(stored)[0][1:] == ({"id": "resp_1"}, "evt_task_1_response_incomplete")
    assert task_events(stored._replace(kind="direct")) == []  # a direct response: never
    assert task_events(stored._replace(batch="batch_1")) == []  # a batch's line: the batch's event only
    assert task_events(stored._replace(status="in_progress")) == []


async def test_a_consumer_emits_an_ended_tasks_events_once(redis: aioredis.Redis, settings: Settings) -> None:
    store = TaskStore(redis, settings)
    task = record(status="queued", finished_at=None,
                  request=wire.encoder.encode(msgspec.convert({"model": "unit-hooks", "input": user_input("hi")},
                                                              wire.ResponseRequest)))
    await store.create(task)
    await redis.hset(keys.stored(task.id), "owner", task.owner)  # type: ignore[misc]  # a stored response
    endpoint = await webhooks.create_endpoint(redis, task.owner, "https://a.example/hook",
                                              ["response.cancelled", "task.cancelled"])
    consumer = FinishedConsumer(redis, stream=f"unit-finished-{uuid.uuid4().hex}", group="unit")
    assert await consumer.announce(task.id) == 0  # not ended yet

    await store.cancel(task)  # a queued task: cancelled at once, its end announced
    announced = await redis.xrevrange(keys.finished(), count=1000)
    assert any(fields[b"task"] == task.id.encode() for _, fields in announced)
    assert await consumer.announce(task.id) == 2
    assert await consumer.announce(task.id) == 0
    found, _ = await webhooks.list_deliveries(redis, endpoint.id, 10)
    assert sorted(d.event_type for d in found) == ["response.cancelled", "task.cancelled"]
    cancelled = await task_end(redis, task.id)
    assert cancelled is not None and cancelled.finished_at is not None and cancelled.stored
    assert all(msgspec.json.decode(d.body)["created_at"] == int(cancelled.finished_at) for d in found)
    assert await task_end(redis, ids.new_id(ids.TASK)) is None


async def test_a_consumer_takes_over_what_a_dead_one_left(redis: aioredis.Redis, settings: Settings) -> None:
    store = TaskStore(redis, settings)
    stream = f"unit-finished-{uuid.uuid4().hex}"
    task = record(status="failed")
    await store.create(task)
    await redis.hset(keys.task(task.id), "status", "failed")  # type: ignore[misc]
    endpoint = await webhooks.create_endpoint(redis, task.owner, "https://a.example/hook", ["task.failed"])
    dead = FinishedConsumer(redis, stream=stream, group="unit")
    await dead.join()
    await redis.xadd(stream, {"task": task.id})
    taken = await redis.xreadgroup("unit", dead.name, {stream: ">"})  # read, never acknowledged
    assert len(taken[0][1]) == 1

    alive = FinishedConsumer(redis, stream=stream, group="unit")
    alive.claim_idle, alive.block = 0.05, 0.05
    await asyncio.sleep(0.1)
    await asyncio.wait_for(alive.step(), timeout=10)
    found, _ = await webhooks.list_deliveries(redis, endpoint.id, 10)
    assert [d.event_type for d in found] == ["task.failed"]
    assert (await redis.xpending(stream, "unit"))["pending"] == 0


# --- one attempt -----------------------------------------------------------------------------------


async def test_an_attempt_is_signed_and_its_answer_kept(redis: aioredis.Redis, settings: Settings) -> None:
    receiver = Receiver()
    sender = Sender(redis, settings.replace(webhook_allow_private=True, webhook_timeout=0.5))
    try:
        owner = principal()
        endpoint = await webhooks.create_endpoint(redis, owner, f"{receiver.url}/hooks?x=1", ["task.completed"])
        delivery = await webhooks.get_delivery(redis, await webhooks.send_test(redis, endpoint))
        assert delivery is not None
        receiver.answers = [503, 302]
        refused, moved, ok = [await sender.attempt(endpoint, delivery) for _ in range(3)]
        assert refused.status_code == 503 and refused.error == "the receiver answered 503"
        assert moved.status_code == 302 and moved.error == "the receiver answered 302"  # never followed
        assert ok.status_code == 200 and ok.error is None and ok.duration_ms >= 0
        received = await receiver.wait(3)
        assert {r.path for r in received} == {"/hooks?x=1"}
        assert {r.headers["webhook-id"] for r in received} == {delivery.event_id}
        assert all(r.body == delivery.body for r in received)
        assert received[0].headers["host"] == receiver.url.removeprefix("http://")
        unwrapped = VERIFIER.unwrap(received[2].body, received[2].headers, secret=endpoint.secret)
        assert unwrapped.type == "webhook.test"  # type: ignore[comparison-overlap]

        receiver.delay = 1.0
        slow = await sender.attempt(endpoint, delivery)
        assert slow.status_code is None and slow.error == "no answer within 0.5 s"
        receiver.delay = 0.0

        strict = Sender(redis, settings.replace(webhook_allow_private=False))
        try:
            blocked = await strict.attempt(endpoint, delivery)
        finally:
            await strict.close()
        assert blocked.status_code is None and blocked.error is not None and blocked.error.startswith("refused")
        assert len(receiver.received) == 4  # the refused attempt sent nothing
    finally:
        await sender.close()
        receiver.close()


async def server_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000
