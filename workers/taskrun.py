"""One claimed task on this worker: prompt in, LMSP events out.

A run takes the prompt the API rendered and checked when it accepted the request (where the API had
no card of the model, or another one than this worker's, the run renders and checks it itself),
hands a generation to the model's engine and, as tokens arrive, appends the events of 6.3 through
the writer (tokens in, events out: ``workers.output.pipeline``): ``response.created``, the output items
(messages with their text deltas, function calls) and one final event. A run that resumes a task
another worker left behind replays the stored token checkpoint silently: the output pipeline (text
decoding, the reasoning section, stop strings, output assembly) and the constraints (grammar,
reasoning budget) are deterministic, so it reaches exactly the state whose events are stored (the
tokens and the events they caused are written in one atomic append), then continues with the same
item ids and the next event number.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from redis.asyncio import Redis

from lmsp_core import tracing, wire
from lmsp_core.requests import grammars
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.requests.chat import PromptRenderer, card_digest
from lmsp_core.requests.closing import GrammarTokenizer, closing_tokens
from lmsp_core.requests.validation import check_output_room, check_request, output_budget
from lmsp_core.settings import Settings
from lmsp_core.store import metrics
from lmsp_core.store.tasks import eventlog, eventstore
from lmsp_core.store.tasks.delivered import DeliveredOutput
from lmsp_core.store.tasks.eventstore import Final
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire.errors import GenerationFailed, LmspError
from lmsp_core.wire.extensions import Extensions
from workers.engine.core import Engine, Finish, Generation
from workers.engine.sampling import LogitsConstraint, RowSampler, SamplingParams, Scores
from workers.output.grammar import GrammarConstraint
from workers.output.items import Mode, OutEvent, OutputAssembler
from workers.output.logprobs import LogprobSpeller
from workers.output.pipeline import OutputPipeline
from workers.output.reasoning import ReasoningConstraint
from workers.writer import DELTAS, EventWriter

logger = logging.getLogger(__name__)

# what a run ended with: the response's final status, or no final event at all
Outcome = wire.ResponseStatus | Literal[Finish.RELEASED, Finish.FENCED]


@dataclass
class ModelRuntime:
    spec: ModelSpec
    engine: Engine
    renderer: PromptRenderer
    grammar_tokenizer: GrammarTokenizer
    card_digest: str = field(init=False)
    speller: LogprobSpeller = field(init=False)

    def __post_init__(self) -> None:
        self.card_digest = card_digest(self.renderer.card)  # what a task's rendered prompt names
        self.speller = LogprobSpeller(self.grammar_tokenizer.ll)


@dataclass
class History:
    """What a previous holder of the task already stored."""

    last_event_id: int = 0
    items: list[wire.OutputItem] = field(default_factory=list)  # as announced, in output order
    tokens: tuple[int, ...] = ()
    # what the stored events delivered
    delivered: DeliveredOutput = field(default_factory=DeliveredOutput, compare=False)


async def load_history(redis: Redis, task_id: str, response_id: str, last_event_id: int) -> History:
    history = History(last_event_id=last_event_id)
    if last_event_id == 0:
        return history
    after = 0
    while after < last_event_id:
        chunk = await eventlog.read_after(redis, task_id, response_id, after)
        if not chunk:
            break
        after = chunk[-1].id
        history.items += [msgspec.json.decode(e.data, type=wire.OutputItemAdded).item
                          for e in chunk if e.name == wire.ITEM_ADDED]
        history.delivered.add_stored(chunk)
    history.tokens = await eventstore.read_tokens(redis, task_id)
    return history


def output_mode(request: wire.ResponseRequest) -> Mode:
    choice = request.tool_choice or "auto"
    if not request.tools or choice == "none":
        return "text"
    return "auto" if choice == "auto" else "calls"


def prefix_scope(owner: str, prompt_cache_key: str | None) -> str:
    """Who may share the task's prompt prefixes: its owner, narrowed by its prompt cache key (an owner
    has no ``/``: its keyed scopes never meet another owner's)."""
    return owner if prompt_cache_key is None else f"{owner}/{prompt_cache_key}"


class TaskRun:
    def __init__(self, record: TaskRecord, runtime: ModelRuntime, writer: EventWriter, settings: Settings,
                 lease: str, recorder: metrics.Recorder | None = None, trace: tracing.RunTrace | None = None) -> None:
        """``trace``: the run's spans, where tracing is on (``lmsp_core.tracing``)."""
        self.record = record
        self.request = msgspec.json.decode(record.request, type=wire.ResponseRequest)
        self.runtime = runtime
        self.writer = writer
        self.settings = settings
        self._lease = lease
        self.sequence: Generation | None = None
        self.outcome: Outcome | None = None
        self._generation_done = asyncio.Event()
        self._durable = asyncio.Event()
        self._ext = Extensions()
        self._pipeline: OutputPipeline | None = None  # built once, when the request has been read
        self._input_tokens = 0
        self._recorder = recorder or metrics.Recorder()
        self._meter: metrics.TokenMeter | None = None
        self.trace = trace
        self._decoding = False  # the run's first token has come
        self._delivered = DeliveredOutput()  # what the task's events delivered, stored and written by this run
        self._output_started = False  # a text delta was published (the events before it are urgent)

    # --- the writer's view (Writable) -----------------------------------------------------------

    @property
    def task_id(self) -> str:
        return self.record.id

    @property
    def lease(self) -> str:
        return self._lease

    @property
    def tokens_used(self) -> int:
        """The tokens this run asked of the model: its prompt and every output token so far."""
        return 0 if self.sequence is None else self._input_tokens + len(self.sequence.generated)

    @property
    def output_tokens(self) -> int:
        """The task's output tokens so far, earlier runs' included."""
        return 0 if self.sequence is None else len(self.sequence.generated)

    @property
    def cached_tokens(self) -> int:
        """Tokens of the prompt found in the engine's slots."""
        return 0 if self.sequence is None else min(self.sequence.cached_tokens, self._input_tokens)

    @property
    def response_id(self) -> str:
        return self.record.response_id

    def on_cancel_requested(self) -> None:
        if self.sequence is not None:
            self.runtime.engine.stop(self.sequence, Finish.CANCELLED)

    def on_fenced(self) -> None:
        self.outcome = Finish.FENCED
        if self.sequence is not None:
            self.runtime.engine.stop(self.sequence, Finish.FENCED)
        self._generation_done.set()
        self._durable.set()

    def on_final_durable(self) -> None:
        if self.outcome in wire.FINAL_STATUSES:
            self._recorder.count(metrics.FINISHED, (self.record.model, self.outcome))
            self._recorder.observe(metrics.E2E, (self.record.model,), max(0.0, time.time() - self.record.created_at))
        self._durable.set()

    # --- running ---------------------------------------------------------------------------------

    async def execute(self, history: History, cancel_requested: bool) -> str:
        """Generate until a final event is stored (or the lease is lost); returns the outcome."""
        self.writer.open(self, history.last_event_id, len(history.tokens))
        self._delivered = history.delivered
        try:
            prompt, budget, constraint = await asyncio.to_thread(self._prepare, history)
            self._start(prompt, budget, constraint, history)
        except LmspError as exc:
            self._fail(exc.problem())
        else:
            if cancel_requested:
                self.on_cancel_requested()
            try:
                async with asyncio.timeout(self.settings.job_timeout):
                    await self._generation_done.wait()
            except TimeoutError:
                assert self.sequence is not None
                self.runtime.engine.stop(self.sequence, Finish.TIMEOUT)
                await self._generation_done.wait()
        await self._durable.wait()
        return str(self.outcome or "done")

    async def hand_back(self) -> None:
        """Stop generating without a final event; store what was produced (worker shutdown)."""
        if self.sequence is not None and self.sequence.finish_reason is None:
            self.runtime.engine.stop(self.sequence, Finish.RELEASED)
        await self._generation_done.wait()
        await self.writer.settled(self.task_id)
        self.writer.close(self.task_id)

    def _prepare(self, history: History) -> tuple[list[int], int, LogitsConstraint | None]:
        """Prompt, token budget and constraint (compiling a grammar can take a while: off the event loop)."""
        spec = self.runtime.spec
        self._ext = self.request.known_extensions
        assembler = OutputAssembler(self.record.response_id, output_mode(self.request), history.items,
                                    logprobs=self._ext.logprobs is not None)
        self._pipeline = OutputPipeline(self.runtime.renderer.tokenizer, assembler, spec.reasoning, self._ext.stop)
        prompt = self.record.prompt_ids(self.runtime.card_digest)
        if prompt is None:  # the API had no card of the model (or another one): the checks fall to us
            items = self.record.input_items(self.request)
            check_request(self.request, spec, items)
            prompt = self.runtime.renderer.prompt_ids(self.request, items)
        budget = output_budget(self.request, spec, len(prompt))
        grammar = grammars.generation_grammar(self.request, reasoning=spec.reasoning)
        return prompt, budget, self._constraint(grammar, budget, history.tokens)

    def _start(self, prompt: list[int], budget: int, constraint: LogitsConstraint | None, history: History) -> None:
        pipeline = self._output_path()
        self._input_tokens = len(prompt)
        if history.last_event_id == 0:
            self._publish([(wire.CREATED, wire.ResponseCreated(response_id=self.record.response_id)),
                           *pipeline.start()])
        else:
            pipeline.replay(history.tokens)  # to where the stored events end: theirs are stored already
            if (message_id := pipeline.assembler.message_id) is not None:  # its stored deltas' entries
                pipeline.assembler.add_logprobs(history.delivered.logprobs(message_id))
        self._count_start(len(prompt), history)
        self._meter = self._recorder.meter(self.record.model, self.record.owner, self.record.created_at,
                                           bool(history.tokens))
        params = SamplingParams(temperature=self.request.temperature or 0.0, top_p=self._ext.top_p or 1.0,
                                seed=self._ext.seed, logprobs=self._ext.logprobs)
        self.sequence = Generation(prompt, budget, RowSampler(params, constraint),
                                   self.runtime.renderer.card.stop_token_ids, sink=self, generated=history.tokens,
                                   prefix_scope=prefix_scope(self.record.owner, self._ext.prompt_cache_key))
        self.runtime.engine.submit(self.sequence)
        if pipeline.stopped:  # the stored tokens already end with a stop string
            self.runtime.engine.stop(self.sequence, Finish.STOP)

    def _count_start(self, prompt_tokens: int, history: History) -> None:
        labels = (self.record.model,)
        if history.last_event_id == 0:
            self._recorder.count(metrics.PROMPT_TOKENS, labels, prompt_tokens)
        if history.tokens:
            self._recorder.count(metrics.RESUMES, labels)
        if self.trace is not None:
            self.trace.prefill(prompt_tokens, len(history.tokens))

    def _constraint(self, grammar: str | None, budget: int, generated: tuple[int, ...]) -> LogitsConstraint | None:
        """The output grammar (completed within ``budget``) and, for a reasoning model, the reasoning budget."""
        reasoning = self.runtime.spec.reasoning
        tokenizer = self.runtime.renderer.tokenizer
        try:
            closing = closing_tokens(tokenizer, reasoning) if reasoning is not None else []
        except ValueError as exc:
            raise GenerationFailed(f"The reasoning section cannot be closed: {exc}") from exc
        constraint: GrammarConstraint | None = None
        if grammar is not None:
            try:
                constraint = GrammarConstraint(self.runtime.grammar_tokenizer, grammar, generated, budget=budget,
                                               closers=[closing] if closing else [])
            except ValueError as exc:
                raise GenerationFailed(f"The output grammar could not be applied: {exc}") from exc
            if not generated:  # a queued request may meet a worker whose model leaves it less room
                check_output_room(self.request, self.runtime.spec, budget, constraint.needed)
        if reasoning is None:
            return constraint
        reasoning_budget = self._ext.reasoning_budget if self._ext.reasoning_budget is not None else reasoning.budget
        return ReasoningConstraint(tokenizer, reasoning, reasoning_budget, closing, constraint, generated)

    def _output_path(self) -> OutputPipeline:
        assert self._pipeline is not None, "the request has not been prepared"
        return self._pipeline

    # --- engine sink -----------------------------------------------------------------------------

    def on_token(self, seq: Generation, token: int, scores: Scores | None) -> None:
        if self._meter is not None:
            self._meter.token()
        if not self._decoding:
            self._decoding = True
            if self.trace is not None:
                self.trace.first_token()
        self.writer.tokens(self, [token])
        pipeline = self._output_path()
        self._publish(pipeline.push(token, self.runtime.speller.entry(token, scores) if scores is not None else None))
        if pipeline.stopped:
            self.runtime.engine.stop(seq, Finish.STOP)

    def on_finish(self, seq: Generation, reason: Finish, error: BaseException | None) -> None:
        if self._meter is not None:
            self._meter.ended()
        if self.trace is not None:
            self.trace.generation_ended(reason.value)
        try:
            if reason is Finish.RELEASED or reason is Finish.FENCED:
                self.outcome = self.outcome or reason
                return
            if reason is Finish.ERROR:
                logger.error("task %s: generation failed: %r", self.task_id, error)
                self._fail(GenerationFailed("The model failed while generating.").problem())
            elif reason is Finish.TIMEOUT:
                self._fail(GenerationFailed(
                    f"Generation ran past the time limit of {self.settings.job_timeout:g} s.",
                    code="generation_timeout").problem())
            else:
                self._complete(seq, reason)
        finally:
            self._generation_done.set()

    # --- events ----------------------------------------------------------------------------------

    def _publish(self, events: list[OutEvent]) -> None:
        """Events out, in order: to the writer, and to what the run has delivered. Until the run's
        first token has given one, its events are urgent: the first token is not held for a flush."""
        for name, data in events:
            self._delivered.add(name, data)
            self.writer.event(self, name, data, urgent=not self._output_started)
            self._output_started = self._output_started or name in DELTAS

    def _publish_one(self, name: str, data: Any) -> None:
        self._publish([(name, data)])

    def _complete(self, seq: Generation, reason: Finish) -> None:
        pipeline = self._output_path()
        items, closing = pipeline.finish()
        self._publish(closing)
        token_details = None
        if self.runtime.spec.reasoning is not None:
            token_details = wire.OutputTokensDetails(reasoning_tokens=pipeline.reasoning_tokens)
        cached = min(seq.cached_tokens, self._input_tokens)  # a resumed context also holds generated tokens
        usage = wire.Usage(input_tokens=self._input_tokens, output_tokens=len(seq.generated),
                           total_tokens=self._input_tokens + len(seq.generated),
                           input_tokens_details=wire.InputTokensDetails(cached_tokens=cached) if cached else None,
                           output_tokens_details=token_details)
        rid = self.record.response_id
        details = None
        if reason is Finish.CANCELLED:
            status: wire.ResponseStatus = "cancelled"
            self._publish_one(wire.CANCELLED, wire.ResponseCancelled(response_id=rid, status=status))
        elif reason is Finish.LENGTH:
            status = "incomplete"
            details = wire.IncompleteDetails(reason="max_output_tokens")
            self._publish_one(wire.INCOMPLETE, wire.ResponseIncomplete(response_id=rid, status=status,
                                                                incomplete_details=details, usage=usage))
        else:
            status = "completed"
            self._publish_one(wire.COMPLETED, wire.ResponseCompleted(response_id=rid, status=status, usage=usage))
        response = self._response(status, items, usage, incomplete=details)
        self.outcome = status
        self.writer.finalize(self, Final(status, wire.encoder.encode(response)))

    def _fail(self, problem: wire.Problem) -> None:
        """End with ``response.failed``. The items the stream delivered stay in the output, those it
        did not finish marked ``incomplete`` (text held back, by stop strings say, was never sent)."""
        rid = self.record.response_id
        output = self._delivered.items()
        self._publish_one(wire.FAILED,
                          wire.ResponseFailed(response_id=rid, status="failed", error=problem, output=output))
        response = self._response("failed", output, None, error=problem)
        self.outcome = "failed"
        self.writer.finalize(self, Final("failed", wire.encoder.encode(response), wire.encoder.encode(problem)))
        self._generation_done.set()

    def _response(self, status: wire.ResponseStatus, output: list[wire.OutputItem], usage: wire.Usage | None,
                  *, incomplete: wire.IncompleteDetails | None = None,
                  error: wire.Problem | None = None) -> wire.Response:
        return wire.Response(id=self.record.response_id, created_at=int(self.record.created_at), status=status,
                             model=self.record.model, output=output, usage=usage, error=error,
                             incomplete_details=incomplete, metadata=self.record.metadata_map())
