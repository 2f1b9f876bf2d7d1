"""Turning a validated request into a queued task: limits, model checks, the task record, the job.

With an ``Idempotency-Key`` a repeat returns the task of the first request instead (see
``lmsp_core.store.tasks.idempotency``). The record is written before the key is reserved, so whoever finds a
reservation also finds its record; a request that loses the reservation race deletes its own record
before anything was queued.
"""

import contextlib
import time
from typing import NamedTuple, Protocol

from redis.exceptions import RedisError

from api.process import Services
from api.submission import admission
from api.submission.admission import admit
from lmsp_core import tracing, wire
from lmsp_core.requests import extensions
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.store import metrics
from lmsp_core.store.objects import conversations
from lmsp_core.store.objects.conversations import StoredResponse
from lmsp_core.store.tasks import fairqueue, idempotency, queue
from lmsp_core.store.tasks.eventstore import pack_tokens
from lmsp_core.store.tasks.records import Kind, TaskRecord, metadata_of
from lmsp_core.store.tenants import principals
from lmsp_core.wire import ids
from lmsp_core.wire.errors import LmspError, ServiceUnavailable, TooManyRequests

QUOTA_RETRY_AFTER = 5


class History(Protocol):
    """Earlier turns a request continues from elsewhere than ``previous_response_id`` (an OpenAI
    conversation: ``api.openai.conversations``), and where its own turn is kept."""

    async def items(self) -> list[wire.InputItem]: ...  # the earlier turns' items, in order

    async def keep(self, record: TaskRecord, request: wire.ResponseRequest) -> None: ...  # before it is queued

    async def forget(self, record: TaskRecord) -> None: ...  # it was never queued


class Submission(NamedTuple):
    record: TaskRecord
    repeated: bool  # an idempotent repeat: the task of an earlier request


async def submit(services: Services, request: wire.ResponseRequest, *, kind: Kind, owner: str,
                 idempotency_key: str | None = None, endpoint: str | None = None,
                 batch: str | None = None, history: History | None = None) -> Submission:
    """Check the request and queue it. Raises LmspError for bad requests and full queues. ``endpoint``
    names the route for ``Idempotency-Key`` fingerprints (default: the kind), so that a key reused on
    another route is refused even when the requests translate to the same LMSP request. ``batch``:
    the batch whose line the task runs; ``history``: the earlier turns of a conversation."""
    print_ = idempotency.fingerprint(endpoint or kind, request) if idempotency_key else ""
    if idempotency_key and (earlier := await idempotency.lookup(services.redis, owner, idempotency_key, print_)):
        return Submission(await _earlier(services, earlier), True)
    spec = services.catalog.get(request.model)
    chain = await _conversation(services, request, spec, owner)
    items = conversations.context(chain, request.input) if chain else None
    if history is not None and (turns := await history.items()):  # an empty conversation adds nothing
        items = [*turns, *request.input]
    rendered, cost = await admit(services, request, spec, kind, items)
    span = tracing.current()  # the request's (or the batch line's): the task's runs join its trace
    record = TaskRecord(
        id=ids.new_id(ids.TASK), model=spec.id, owner=owner, kind=kind, status="queued",
        created_at=time.time(), response_id=ids.new_id(ids.RESPONSE), request=wire.encoder.encode(request),
        context=None if items is None else wire.encoder.encode(items),
        prompt=None if rendered is None else pack_tokens(rendered.token_ids),
        prompt_card=None if rendered is None else rendered.card_digest, metadata=metadata_of(request),
        cost=cost, batch=batch, trace=span.traceparent,
    )
    span.set({"gen_ai.request.model": spec.id, "gen_ai.response.id": record.response_id, "lmsp.task.id": record.id})
    await services.store.create(record)
    if idempotency_key:
        try:
            winner = await idempotency.reserve(services.redis, owner, idempotency_key, print_, record.id,
                                               _key_ttl(services))
        except BaseException:
            await _forget(services, record)
            raise
        if winner is not None:
            await _forget(services, record)  # never queued: nothing was generated for it
            return Submission(await _earlier(services, winner), True)
    priority = extensions.priority(request, direct=kind == "direct")
    try:
        fair = await _ticket(services, record)
        if request.store and spec.has("conversations"):
            await services.conversations.store(record, request, chain)
        if history is not None:
            await history.keep(record, request)
        place = queue.score(record.created_at, priority, services.settings.priority_step)
        if not await queue.enqueue(services.redis, record.id, spec.id, place, fair=fair):
            raise _over_quota(record, fair)
        # acknowledged once a replica holds it too (or the wait timed out): a failover then keeps it
        await services.store.replicated(record.id)
    except (RedisError, LmspError):
        await _forget(services, record, history)
        if idempotency_key:
            with contextlib.suppress(RedisError):
                await idempotency.release(services.redis, owner, idempotency_key, record.id)
        raise
    with contextlib.suppress(RedisError):  # the task is queued; a lost count is not worth an error
        await metrics.add_now(services.redis, metrics.CREATED, (spec.id, kind))
    return Submission(record, False)


async def count_input_tokens(services: Services, request: wire.ResponseRequest, *, owner: str) -> int:
    """The tokens of the prompt ``submit`` would give the request, its conversation included, without
    submitting it: nothing is stored."""
    spec = services.catalog.get(request.model)
    chain = await _conversation(services, request, spec, owner)
    items = conversations.context(chain, request.input) if chain else None
    return await admission.count(services, request, spec, items)


async def _ticket(services: Services, record: TaskRecord) -> tuple[fairqueue.FairQueue, queue.Ticket] | None:
    """The job's ticket for the fair queue, with its principal's quota (None: fair share is off)."""
    if not services.settings.fair_share:
        return None
    settings = await principals.get(services.redis, record.owner)
    return services.store.fair, queue.Ticket(record.owner, record.cost, settings.max_queued)


def _over_quota(record: TaskRecord, fair: tuple[fairqueue.FairQueue, queue.Ticket] | None) -> TooManyRequests:
    limit = fair[1].max_queued if fair is not None else None
    return TooManyRequests(f"Principal {record.owner!r} already has {limit} tasks waiting for model {record.model!r} "
                           "(its max_queued); retry once some have started.", retry_after=QUOTA_RETRY_AFTER,
                           code="queue_quota_exceeded")


async def _conversation(services: Services, request: wire.ResponseRequest, spec: ModelSpec,
                        owner: str) -> list[StoredResponse]:
    """The earlier turns a request continues (none without previous_response_id)."""
    if request.previous_response_id is None or not spec.has("conversations"):
        return []  # without the capability, check_request refuses previous_response_id
    return await services.conversations.chain(request.previous_response_id, owner)


async def _earlier(services: Services, task_id: str) -> TaskRecord:
    record = await services.store.get(task_id)
    if record is None:  # only while its first request fails to queue it (Redis failing): retry
        raise ServiceUnavailable("The task of this Idempotency-Key is not available yet; retry shortly.",
                                 retry_after=1)
    return record


def _key_ttl(services: Services) -> float:
    # a task record lives at least LMSP_TASK_RETENTION after it is created, so a reservation that
    # lives no longer than that never outlives its task
    return min(services.settings.idempotency_ttl, services.settings.task_retention)


async def _forget(services: Services, record: TaskRecord, history: History | None = None) -> None:
    # if Redis is gone the orphan record stays; it is never run, and the client saw an error
    with contextlib.suppress(RedisError):
        await services.store.delete(record)
        await services.conversations.forget(record)
        if history is not None:
            await history.forget(record)
