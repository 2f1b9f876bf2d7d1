"""Admission: every check of a request before anything of it is stored, in one call (``admit``).

The request is checked against the service's limits and its model once, here: capabilities,
extensions, grammars; its prompt is rendered with the model's chat template and counted, and the
shortest output its grammar allows must fit its budget. A direct response needs a running worker,
and every request room in its model's queue.
"""

import asyncio
from typing import NamedTuple

from tokenizers import Tokenizer

from api.process import Services
from lmsp_core import wire
from lmsp_core.requests import grammars
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.requests.closing import GrammarTokenizer, output_tokens_needed, reasoning_closing_ids
from lmsp_core.requests.validation import check_limits, check_output_room, check_request, output_budget
from lmsp_core.store import registry
from lmsp_core.store.tasks import fairqueue, queue
from lmsp_core.store.tasks.records import Kind
from lmsp_core.wire.errors import ServiceUnavailable

BUSY_RETRY_AFTER = 5


class Rendered(NamedTuple):
    token_ids: list[int]
    card_digest: str


class Admission(NamedTuple):
    rendered: Rendered | None  # the prompt, None where the API has no card of the model yet
    cost: int  # what the task asks for (``fairqueue.cost``)


async def admit(services: Services, request: wire.ResponseRequest, spec: ModelSpec, kind: Kind,
                 items: list[wire.InputItem] | None) -> Admission:
    """Every check of the request, in one call before anything is stored (the worker trusts a
    task's rendered prompt): its limits, the model's capabilities, extensions and grammars, the
    prompt's and the output's lengths, a worker for a direct response, room in the model's queue.
    Returns the rendered prompt and what the task costs."""
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
    return Admission(rendered, _cost(request, spec, rendered))


async def count(services: Services, request: wire.ResponseRequest, spec: ModelSpec,
                items: list[wire.InputItem] | None) -> int:
    """The tokens of the prompt ``admit`` would render for the request (``POST
    /v1/responses/input_tokens``), after the same checks of the request itself; neither its lengths
    nor workers or queues are checked: counting is how a client learns whether it fits."""
    check_limits(request, services.settings)
    check_request(request, spec, items)
    text = await services.model_text(spec.id)
    if text is None:
        raise ServiceUnavailable(f"Model {spec.id!r}'s tokenizer is not at hand: no worker has published it and "
                                 "its files cannot be read here; retry once a worker runs the model.",
                                 code="model_unavailable", retry_after=BUSY_RETRY_AFTER)
    return len(await asyncio.to_thread(text.renderer.prompt_ids, request, items))


def _cost(request: wire.ResponseRequest, spec: ModelSpec, rendered: Rendered | None) -> int:
    """What the task asks for (``fairqueue.cost``); without a rendered prompt, its output budget."""
    if rendered is None:
        return fairqueue.cost(0, request.max_output_tokens or spec.max_output_tokens)
    return fairqueue.cost(len(rendered.token_ids), output_budget(request, spec, len(rendered.token_ids)))


async def _check_lengths(services: Services, request: wire.ResponseRequest, spec: ModelSpec,
                         items: list[wire.InputItem] | None) -> Rendered | None:
    """The prompt fits the context window, and the shortest complete output of a grammar (a forced
    call, json_schema) fits the output budget: counted with the model's tokenizer, which the API
    has with or without a worker (``api.modeltext``). Returns the rendered prompt."""
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
