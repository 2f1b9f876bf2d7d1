"""One claimed task on this worker: prompt in, LMSP events out.

A run renders the prompt, hands a sequence to the model's engine and, as tokens arrive, appends
the events of 6.3 through the writer: ``response.created``, the output items (messages with their
text deltas, function calls) and one final event. A run that resumes a task another worker left
behind replays the stored token checkpoint silently: the output pipeline (text decoding, the
reasoning section, stop strings, output assembly) and the constraints (grammar, reasoning budget)
are deterministic, so it reaches exactly the state whose events are stored (the tokens and
the events they caused are written in one atomic append), then continues with the same item ids
and the next event number.
"""

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.asyncio import Redis

from lmsp_core import eventlog, extensions, grammars, keys, metrics, wire
from lmsp_core.catalog import ModelSpec
from lmsp_core.chat import PromptRenderer
from lmsp_core.closing import GrammarTokenizer
from lmsp_core.errors import GenerationFailed, LmspError
from lmsp_core.settings import Settings
from lmsp_core.tasks import TaskRecord
from lmsp_core.validation import check_output_room, check_request, output_budget
from workers import engine as eng
from workers.engine import Engine, Sequence
from workers.grammar import GrammarConstraint
from workers.output import Mode, OutputAssembler
from workers.pipeline import OutputPipeline
from workers.reasoning import ReasoningConstraint, closing_tokens
from workers.sampling import LogitsConstraint, RowSampler, SamplingParams
from workers.writer import EventWriter, Final, unpack_tokens

logger = logging.getLogger(__name__)

CANCELLED = "cancelled"
TIMEOUT = "timeout"
RELEASED = "released"  # handed back to the queue (worker shutdown); no final event
FENCED = "fenced"  # another worker holds the task now; no final event


@dataclass
class ModelRuntime:
    spec: ModelSpec
    engine: Engine
    renderer: PromptRenderer
    grammar_tokenizer: GrammarTokenizer


@dataclass
class History:
    """What a previous holder of the task already stored."""

    last_event_id: int = 0
    items: list[wire.OutputItem] = field(default_factory=list)  # as announced, in output order
    tokens: tuple[int, ...] = ()


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
    history.tokens = tuple(unpack_tokens(await redis.get(keys.tokens(task_id)) or b""))
    return history


def output_mode(request: wire.ResponseRequest) -> Mode:
    choice = request.tool_choice or "auto"
    if not request.tools or choice == "none":
        return "text"
    return "auto" if choice == "auto" else "calls"


class TaskRun:
    def __init__(self, record: TaskRecord, runtime: ModelRuntime, writer: EventWriter, settings: Settings,
                 lease: str, recorder: metrics.Recorder | None = None) -> None:
        self.record = record
        self.request = msgspec.json.decode(record.request, type=wire.ResponseRequest)
        self.runtime = runtime
        self.writer = writer
        self.settings = settings
        self._lease = lease
        self.sequence: Sequence | None = None
        self.outcome: str | None = None
        self._generation_done = asyncio.Event()
        self._durable = asyncio.Event()
        self._output = OutputAssembler(record.response_id, self._emit, output_mode(self.request))
        self._ext = extensions.Extensions()
        self._pipeline = OutputPipeline(runtime.renderer.tokenizer, self._output)
        self._input_tokens = 0
        self._recorder = recorder or metrics.Recorder()
        self._meter: metrics.TokenMeter | None = None

    # --- the writer's view (Writable) -----------------------------------------------------------

    @property
    def task_id(self) -> str:
        return self.record.id

    @property
    def lease(self) -> str:
        return self._lease

    @property
    def response_id(self) -> str:
        return self.record.response_id

    def on_cancel_requested(self) -> None:
        if self.sequence is not None:
            self.runtime.engine.stop(self.sequence, CANCELLED)

    def on_fenced(self) -> None:
        self.outcome = FENCED
        if self.sequence is not None:
            self.runtime.engine.stop(self.sequence, FENCED)
        self._generation_done.set()
        self._durable.set()

    def on_final_durable(self) -> None:
        if self.outcome in wire.FINAL_STATUSES:
            self._recorder.count(metrics.FINISHED, (self.record.model, self.outcome))
        self._durable.set()

    # --- running ---------------------------------------------------------------------------------

    async def execute(self, history: History, cancel_requested: bool) -> str:
        """Generate until a final event is stored (or the lease is lost); returns the outcome."""
        self.writer.open(self, history.last_event_id, len(history.tokens))
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
                self.runtime.engine.stop(self.sequence, TIMEOUT)
                await self._generation_done.wait()
        await self._durable.wait()
        return self.outcome or "done"

    async def hand_back(self) -> None:
        """Stop generating without a final event; store what was produced (worker shutdown)."""
        if self.sequence is not None and self.sequence.finish_reason is None:
            self.runtime.engine.stop(self.sequence, RELEASED)
        await self._generation_done.wait()
        await self.writer.settled(self.task_id)
        self.writer.close(self.task_id)

    def _prepare(self, history: History) -> tuple[list[int], int, LogitsConstraint | None]:
        """Prompt, token budget and constraint (compiling a grammar can take a while: off the event loop)."""
        spec = self.runtime.spec
        items = self.record.input_items(self.request)
        check_request(self.request, spec, items)
        self._ext = extensions.parse(self.request.extensions)
        self._pipeline = OutputPipeline(self.runtime.renderer.tokenizer, self._output, spec.reasoning, self._ext.stop)
        prompt = self.runtime.renderer.prompt_ids(self.request, items)
        budget = output_budget(self.request, spec, len(prompt))
        grammar = grammars.generation_grammar(self.request, reasoning=spec.reasoning)
        return prompt, budget, self._constraint(grammar, budget, history.tokens)

    def _start(self, prompt: list[int], budget: int, constraint: LogitsConstraint | None, history: History) -> None:
        self._input_tokens = len(prompt)
        if history.last_event_id == 0:
            self._emit(wire.CREATED, wire.ResponseCreated(response_id=self.record.response_id))
            self._pipeline.start()
        else:
            self._replay(history)
        self._meter = self._recorder.meter(self.record.model, self.record.created_at, bool(history.tokens))
        params = SamplingParams(temperature=self.request.temperature or 0.0, top_p=self._ext.top_p or 1.0,
                                seed=self._ext.seed)
        self.sequence = Sequence(prompt, budget, RowSampler(params, constraint),
                                 self.runtime.renderer.card.stop_token_ids, sink=self, generated=history.tokens)
        self.runtime.engine.submit(self.sequence)
        if self._pipeline.stopped:  # the stored tokens already end with a stop string
            self.runtime.engine.stop(self.sequence, eng.STOP)

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

    def _replay(self, history: History) -> None:
        """Bring decoding and output assembly to where the stored events end, emitting nothing."""
        self._output.known = history.items
        self._output.emit = lambda name, data: None
        self._pipeline.start()
        self._pipeline.replay(history.tokens)
        self._output.emit = self._emit

    # --- engine sink -----------------------------------------------------------------------------

    def on_token(self, seq: Sequence, token: int) -> None:
        if self._meter is not None:
            self._meter.token()
        self.writer.tokens(self, [token])
        self._pipeline.push(token)
        if self._pipeline.stopped:
            self.runtime.engine.stop(seq, eng.STOP)

    def on_finish(self, seq: Sequence, reason: str, error: BaseException | None) -> None:
        try:
            if reason in (RELEASED, FENCED):
                self.outcome = self.outcome or reason
                return
            if reason == eng.ERROR:
                logger.error("task %s: generation failed: %r", self.task_id, error)
                self._fail(GenerationFailed("The model failed while generating.").problem())
            elif reason == TIMEOUT:
                self._fail(GenerationFailed(
                    f"Generation ran past the time limit of {self.settings.job_timeout:g} s.",
                    code="generation_timeout").problem())
            else:
                self._complete(seq, reason)
        finally:
            self._generation_done.set()

    # --- events ----------------------------------------------------------------------------------

    def _emit(self, name: str, data: Any) -> None:
        self.writer.event(self, name, wire.encoder.encode(data))

    def _complete(self, seq: Sequence, reason: str) -> None:
        items = self._pipeline.finish()
        token_details = None
        if self.runtime.spec.reasoning is not None:
            token_details = wire.OutputTokensDetails(reasoning_tokens=self._pipeline.reasoning_tokens)
        usage = wire.Usage(input_tokens=self._input_tokens, output_tokens=len(seq.generated),
                           total_tokens=self._input_tokens + len(seq.generated), output_tokens_details=token_details)
        rid = self.record.response_id
        details = None
        if reason == CANCELLED:
            status: wire.ResponseStatus = "cancelled"
            self._emit(wire.CANCELLED, wire.ResponseCancelled(response_id=rid, status=status))
        elif reason == eng.LENGTH:
            status = "incomplete"
            details = wire.IncompleteDetails(reason="max_output_tokens")
            self._emit(wire.INCOMPLETE, wire.ResponseIncomplete(response_id=rid, status=status,
                                                                incomplete_details=details, usage=usage))
        else:
            status = "completed"
            self._emit(wire.COMPLETED, wire.ResponseCompleted(response_id=rid, status=status, usage=usage))
        response = self._response(status, items, usage, incomplete=details)
        self.outcome = status
        self.writer.finalize(self, Final(status, wire.encoder.encode(response)))

    def _fail(self, problem: wire.Problem) -> None:
        rid = self.record.response_id
        self._emit(wire.FAILED, wire.ResponseFailed(response_id=rid, status="failed", error=problem))
        response = self._response("failed", [], None, error=problem)
        self.outcome = "failed"
        self.writer.finalize(self, Final("failed", wire.encoder.encode(response), wire.encoder.encode(problem)))
        self._generation_done.set()

    def _response(self, status: wire.ResponseStatus, output: list[wire.OutputItem], usage: wire.Usage | None,
                  *, incomplete: wire.IncompleteDetails | None = None,
                  error: wire.Problem | None = None) -> wire.Response:
        return wire.Response(id=self.record.response_id, created_at=int(self.record.created_at), status=status,
                             model=self.record.model, output=output, usage=usage, error=error,
                             incomplete_details=incomplete)
