"""Turning a validated request into a queued task: limits, model checks, the task record, the job.

With an ``Idempotency-Key`` a repeat returns the task of the first request instead (see
``api.idempotency``). The record is written before the key is reserved, so whoever finds a
reservation also finds its record; a request that loses the reservation race deletes its own record
before anything was queued.
"""

import asyncio
import contextlib
import time
from typing import NamedTuple

from redis.exceptions import RedisError
from tokenizers import Tokenizer

from api import idempotency
from api.services import Services
from lmsp_core import tracing, wire
from lmsp_core.requests import extensions, grammars
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.requests.closing import GrammarTokenizer, output_tokens_needed, reasoning_closing_ids
from lmsp_core.requests.validation import check_limits, check_output_room, check_request, output_budget
from lmsp_core.store import connections, conversations, fairqueue, keys, metrics, principals, queue, registry
from lmsp_core.store.conversations import StoredResponse
from lmsp_core.store.eventstore import pack_tokens
from lmsp_core.store.tasks import Kind, TaskRecord
from lmsp_core.wire import ids
from lmsp_core.wire.errors import ServiceUnavailable, TooManyRequests

BUSY_RETRY_AFTER = 5
QUOTA_RETRY_AFTER = 5


class Submission(NamedTuple):
    record: TaskRecord
    repeated: bool  # an idempotent repeat: the task of an earlier request


async def submit(services: Services, request: wire.ResponseRequest, *, kind: Kind, owner: str,
                 idempotency_key: str | None = None, endpoint: str | None = None,
                 batch: str | None = None) -> Submission:
    """Check the request and queue it. Raises LmspError for bad requests and full queues. ``endpoint``
    names the route for ``Idempotency-Key`` fingerprints (default: the kind), so that a key reused on
    another route is refused even when the requests translate to the same LMSP request. ``batch``:
    the batch whose line the task runs."""
    print_ = idempotency.fingerprint(endpoint or kind, request) if idempotency_key else ""
    if idempotency_key and (earlier := await idempotency.lookup(services.redis, owner, idempotency_key, print_)):
        return Submission(await _earlier(services, earlier), True)
    spec = services.catalog.get(request.model)
    chain = await _conversation(services, request, spec, owner)
    items = conversations.context(chain, request.input) if chain else None
    rendered = await _admit(services, request, spec, kind, items)
    span = tracing.current()  # the request's (or the batch line's): the task's runs join its trace
    record = TaskRecord(
        id=ids.new_id(ids.TASK), model=spec.id, owner=owner, kind=kind, status="queued",
        created_at=time.time(), response_id=ids.new_id(ids.RESPONSE), request=wire.encoder.encode(request),
        context=None if items is None else wire.encoder.encode(items),
        prompt=None if rendered is None else pack_tokens(rendered.token_ids),
        prompt_card=None if rendered is None else rendered.card_digest, metadata=_metadata(request),
        cost=_cost(request, spec, rendered), batch=batch, trace=span.traceparent,
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
        place = queue.score(record.created_at, priority, services.settings.priority_step)
        if not await queue.enqueue(services.redis, record.id, spec.id, place, fair=fair):
            raise _over_quota(record, fair)
        # acknowledged once a replica holds it too (or the wait timed out): a failover then keeps it
        await connections.replicated(services.redis, services.replicas, keys.task(record.id))
    except (RedisError, TooManyRequests):
        await _forget(services, record)
        if idempotency_key:
            with contextlib.suppress(RedisError):
                await idempotency.release(services.redis, owner, idempotency_key, record.id)
        raise
    with contextlib.suppress(RedisError):  # the task is queued; a lost count is not worth an error
        await metrics.add_now(services.redis, metrics.CREATED, (spec.id, kind))
    return Submission(record, False)


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


def _cost(request: wire.ResponseRequest, spec: ModelSpec, rendered: "Rendered | None") -> int:
    """What the task asks for (``fairqueue.cost``); without a rendered prompt, its output budget."""
    if rendered is None:
        return fairqueue.cost(0, request.max_output_tokens or spec.max_output_tokens)
    return fairqueue.cost(len(rendered.token_ids), output_budget(request, spec, len(rendered.token_ids)))


def _metadata(request: wire.ResponseRequest) -> bytes | None:
    metadata = extensions.parse(request.extensions).metadata
    return None if metadata is None else wire.encoder.encode(metadata)


async def _conversation(services: Services, request: wire.ResponseRequest, spec: ModelSpec,
                        owner: str) -> list[StoredResponse]:
    """The earlier turns a request continues (none without previous_response_id)."""
    if request.previous_response_id is None or not spec.has("conversations"):
        return []  # without the capability, check_request refuses previous_response_id
    return await services.conversations.chain(request.previous_response_id, owner)


class Rendered(NamedTuple):
    token_ids: list[int]
    card_digest: str


async def _admit(services: Services, request: wire.ResponseRequest, spec: ModelSpec, kind: Kind,
                 items: list[wire.InputItem] | None) -> Rendered | None:
    """Every check of the request, done here once (the worker trusts a task's rendered prompt);
    returns that prompt, or None where the API has no card of the model yet."""
    check_limits(request, services.settings)
    check_request(request, spec, items)
    rendered = await _check_lengths(services, request, spec, items)  # can never run: 400 before any 503
    if kind == "direct" and not (await registry.workers_per_model(services.redis))[spec.id]:
        raise ServiceUnavailable(f"No worker is running model {spec.id!r} right now; retry later, or create "
                                 "a task, which waits in the queue for a worker.", code="model_unavailable",
                                 retry_after=5)
    limit = spec.max_queue_depth if spec.max_queue_depth is not None else services.settings.max_queue_depth
    if limit and await queue.depth(services.redis, spec.id) >= limit:
        raise ServiceUnavailable(f"The queue of model {spec.id!r} is full ({limit} tasks); retry later.",
                                 code="server_busy", retry_after=BUSY_RETRY_AFTER)
    return rendered


async def _check_lengths(services: Services, request: wire.ResponseRequest, spec: ModelSpec,
                         items: list[wire.InputItem] | None) -> Rendered | None:
    """The prompt fits the context window, and the shortest complete output of a grammar (a forced
    call, json_schema) fits the output budget: counted with the model's tokenizer, which the API
    has with or without a worker (``api.tokenizing``). Returns the rendered prompt."""
    text = await services.model_text(spec.id)
    if text is None:  # no card and no files: the worker checks the lengths when it starts the task
        return None
    prompt = await asyncio.to_thread(text.renderer.prompt_ids, request, items)
    budget = output_budget(request, spec, len(prompt))
    if request.tools or request.response_format is not None:
        tokenizer = await text.grammar()
        needed = await asyncio.to_thread(_needed, request, spec, text.renderer.tokenizer, tokenizer)
        check_output_room(request, spec, budget, needed)
    return Rendered(prompt, text.card_digest)


def _needed(request: wire.ResponseRequest, spec: ModelSpec, text_tokenizer: Tokenizer,
            tokenizer: GrammarTokenizer) -> int | None:
    """Tokens of the shortest output that completes the request's grammar (None: no grammar, or no minimum)."""
    grammar = grammars.generation_grammar(request, reasoning=spec.reasoning)
    if grammar is None:
        return None
    closers = [reasoning_closing_ids(text_tokenizer, spec.reasoning)] if spec.reasoning else []
    return output_tokens_needed(tokenizer, grammar, closers)


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


async def _forget(services: Services, record: TaskRecord) -> None:
    # if Redis is gone the orphan record stays; it is never run, and the client saw an error
    with contextlib.suppress(RedisError):
        await services.store.delete(record)
        await services.conversations.forget(record)
