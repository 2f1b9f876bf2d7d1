"""The engine's model thread: which sequences run in each step, and running it.

A step: sequences asked to stop leave (their slots are free at once), waiting sequences take free
slots, every decoding sequence gets its next token, and joining sequences' prompts go in as chunks
in the same model call. While others decode, a step takes only as many prompt tokens as cost about
``STALL`` decoding steps (measured as it runs, attention deep in a prompt included:
``workers.engine.chunkprice``), so a long prompt joins over several steps instead of stalling
everyone for its whole length; a sequence whose prompt is complete gets its first token from its
last chunk. A sequence whose context begins with tokens a slot already holds starts after them
(``workers.engine.prefixes``). Where that takes copies between slots while others run, and the model
is on a CPU, the copies run on a thread of their own and the sequence takes its slot at the first
step after they are done: copying a long prefix into memory not committed yet is slow, and every
running stream waited for it when the copies ran between two steps
(docs/performance.md, "Prompt prefixes kept in the slots").

The thread runs steps back to back and hands each step's tokens to the event loop, at most
``AHEAD`` steps ahead of it: the next step is under way while the events of the last one are
written. What the loop decides (a cancellation, a stop string) reaches the thread as
``Generation.stop_requested`` and takes effect at the next step; the loop drops tokens generated for
a sequence after it asked it to stop.

Launching ahead (``launch_ahead``, a GPU's): the device runs a step while the host waits for its
tokens, then the host reads them, decides the next step and launches it, while the device waits
(a noticeable part of a short step: docs/performance.md, "On a GPU"). So where the next
step can only feed every decoding sequence the token just chosen for it (nobody joins, waits,
leaves by its budget or is constrained), it is launched before those tokens are read, fed them on
the device (``SlotModel.run``'s ``fed``). A sequence that ends on a stop token meanwhile wastes its
row of that step, whose token is dropped: the tokens are those of steps run one at a time.
"""

import heapq
import logging
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from workers.engine.chunkprice import MAX_CHUNK, MIN_CHUNK, ChunkCost, chunk_budget
from workers.engine.generation import Finish, Generation
from workers.engine.prefixes import Prefixes
from workers.engine.sampling import Chosen, Scores, TokenChooser
from workers.model.plan import FED, Chunk, Feed, SlotModel, StepPlan

logger = logging.getLogger(__name__)

AHEAD = 2  # steps the model thread may run ahead of the event loop's delivery
PREFILL_TOKENS = 2048  # prompt tokens of a step while nobody decodes (a burst of prompts goes in at once)
FIRST_CHUNK = 16  # while the costs are not measured yet
# a decoding step's price: the median of this many recent ones (a running mean kept the few slow
# steps of streams starting, and every chunk of the join that followed took more)
DECODE_STEPS = 15


class Produced(NamedTuple):
    """What a step did for a sequence: a token, and why it finished (None: it goes on). A tuple: a
    step makes one a sequence."""

    seq: Generation
    token: int | None
    reason: Finish | None = None
    error: BaseException | None = None
    scores: Scores | None = None  # the token's log-probabilities, where the sequence asked for them


@dataclass(eq=False)
class _Running:
    seq: Generation
    slot: int
    context: list[int]  # the prompt, and the tokens generated before a resume
    count: int  # tokens generated so far, those before a resume included
    filled: int = 0  # positions of the slot written so far
    next_token: int = -1  # the token to feed next; -1 while the context is being prefilled
    fed: list[int] = field(default_factory=list)  # tokens fed after the context, in order

    @property
    def held(self) -> list[int]:
        """The tokens whose keys and values the slot holds, by position."""
        return (self.context + self.fed)[:self.filled]

    @property
    def decoding(self) -> bool:
        return self.next_token >= 0


@dataclass(eq=False)
class _Launched:
    """A step under way on the device: what it feeds, and its tokens once read."""

    plan: StepPlan
    decoding: list[_Running]
    chunked: list[tuple[_Running, Chunk]]
    chosen: Chosen
    started: float

    @property
    def outputs(self) -> list[_Running]:
        return outputs_of(self.decoding, self.chunked)


def outputs_of(decoding: list[_Running], chunked: list[tuple[_Running, Chunk]]) -> list[_Running]:
    """The sequences whose logits a step returns, in order: every decoding one, then each whose prompt
    the step completes."""
    return decoding + [run for run, chunk in chunked if chunk.last]


class Scheduler:
    def __init__(self, model: SlotModel, chooser: TokenChooser, context_window: int, name: str,
                 reuse_prefixes: bool = False, copy_beside_steps: bool = False, launch_ahead: bool = False) -> None:
        """``reuse_prefixes``: start sequences from the prefixes slots hold (the model must keep them);
        ``copy_beside_steps``: their copies between slots run beside the steps of others (a CPU's);
        ``launch_ahead``: a decoding step starts before the last one's tokens are read (a GPU's)."""
        self.model = model
        self.chooser = chooser
        self.window = context_window
        self.launch_ahead = launch_ahead
        self._cond = threading.Condition()
        self._incoming: list[Generation] = []
        self._closed = False
        self._ahead = 0
        self._deliver: Callable[[list[Produced]], None] = lambda produced: None
        self._warm_up: Callable[[], None] = lambda: None
        # the model thread's own state
        self._waiting: deque[Generation] = deque()
        self._running: dict[int, _Running] = {}  # by slot, in order of admission
        self._free = list(range(model.slots))
        self._prefixes = Prefixes(model.slots) if reuse_prefixes else None
        self._copier = ThreadPoolExecutor(1, f"copies-{name}") if reuse_prefixes and copy_beside_steps else None
        self._copying: tuple[_Running, Future[None]] | None = None  # a sequence waiting for its copies
        self._decode_seconds: float | None = None  # the median of the recent decoding steps
        self._decode_recent: deque[float] = deque(maxlen=DECODE_STEPS)
        self._chunk_cost = ChunkCost()
        self._last_chunked = FIRST_CHUNK  # prompt tokens of the last step with chunks beside decoding
        self._following: _Launched | None = None  # a step launched before its predecessor's tokens were read
        self._last_read = 0.0  # when the last step's tokens were read
        self._rows = 0  # sequences of the step just completed
        self._step_sizes: Counter[int] = Counter()  # steps per sequences a step, until taken (under _cond)
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)

    # --- called from the event loop -------------------------------------------------------------

    def start(self, deliver: Callable[[list[Produced]], None], warm_up: Callable[[], None]) -> None:
        """Run ``warm_up`` on the model thread, then steps; ``deliver`` gets each step's tokens
        (called on the model thread)."""
        self._deliver = deliver
        self._warm_up = warm_up
        self._thread.start()

    def add(self, seq: Generation) -> None:
        with self._cond:
            self._incoming.append(seq)
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def delivered(self) -> None:
        """The loop has taken one delivery: the thread may run another step ahead."""
        with self._cond:
            self._ahead -= 1
            self._cond.notify()

    def take_step_sizes(self) -> Counter[int]:
        """How many steps ran with how many sequences, since the last call."""
        with self._cond:
            taken, self._step_sizes = self._step_sizes, Counter()
        return taken

    def occupancy(self) -> tuple[int, int]:
        """Slots held by sequences now, and sequences waiting for one (read from the event loop:
        a moment's view)."""
        with self._cond:
            return len(self._running) + (self._copying is not None), len(self._waiting) + len(self._incoming)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    # --- the model thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        self._warm_up()
        while True:
            with self._cond:
                self._cond.wait_for(self._ready)
                if self._closed:
                    return
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            self._rows = 0
            produced = self._step()
            if self._rows:
                with self._cond:
                    self._step_sizes[self._rows] += 1
            if produced:
                with self._cond:
                    self._ahead += 1
                self._deliver(produced)

    def _ready(self) -> bool:
        return self._closed or (self._ahead < AHEAD and bool(self._incoming or self._waiting or self._running
                                                             or self._copying or self._following))

    def _step(self) -> list[Produced]:
        """Run a step (or take the one launched ahead), launch the next one ahead where it may, and
        return what the first one produced."""
        produced: list[Produced] = []
        launched, self._following = self._following, None
        if launched is None:
            self._drop_stopped()
            produced = self._admit()
            decoding = [run for run in self._running.values() if run.decoding]
            chunked = self._chunked(decoding)
            plan = StepPlan(feeds=[Feed(run.slot, run.next_token, run.filled) for run in decoding],
                            chunks=[chunk for _, chunk in chunked])
            if not plan.feeds and not plan.chunks:
                return produced
        try:
            if launched is None:
                launched = self._launch(plan, decoding, chunked)
            if self.launch_ahead and self._may_follow(launched):
                following = StepPlan(feeds=[Feed(feed.slot, FED, feed.position + 1) for feed in launched.plan.feeds])
                self._following = self._launch(following, launched.decoding, [], launched.chosen)
            tokens = launched.chosen.read()
        except Exception as exc:
            logger.exception("model step failed; failing %d sequences", len(self._running))
            return produced + self._fail_all(exc)
        return produced + self._complete(launched, tokens)

    def _launch(self, plan: StepPlan, decoding: list[_Running], chunked: list[tuple[_Running, Chunk]],
                previous: Chosen | None = None) -> _Launched:
        """Start ``plan`` on the device (fed ``previous``'s tokens, where given) and the choice of its tokens."""
        started = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.run(plan) if previous is None else self.model.run(plan, previous.tokens)
            chosen = self.chooser.launch(logits, [run.seq.sampler for run in outputs_of(decoding, chunked)])
        return _Launched(plan, decoding, chunked, chosen, started)

    def _may_follow(self, launched: _Launched) -> bool:
        """Whether the next step may be launched before ``launched``'s tokens are read: it would only
        feed every decoding sequence its token from ``launched`` (none joins, waits, leaves or has a
        constraint, and ``launched`` ends none by its budget)."""
        with self._cond:
            arriving = bool(self._incoming)
        if launched.chunked or arriving or self._waiting or self._copying is not None \
                or len(launched.decoding) != len(self._running):
            return False
        return all(self._running.get(run.slot) is run and run.seq.stop_requested is None
                   and run.seq.sampler.constraint is None and run.count + 1 < run.seq.max_new_tokens
                   and len(run.seq.prompt_ids) + run.count + 1 < self.window for run in launched.decoding)

    def _complete(self, launched: _Launched, tokens: list[int]) -> list[Produced]:
        """Take a step's tokens: its sequences advance (those that left while it ran get nothing)."""
        now = time.perf_counter()
        # a step launched ahead ran partly while the one before was read: count it from then
        self._measure(launched.plan, now - max(launched.started, self._last_read))
        self._last_read = now
        self._rows = len(launched.plan.feeds) + len(launched.plan.chunks)
        for run in launched.decoding:
            if self._running.get(run.slot) is run:
                run.filled += 1
                run.fed.append(run.next_token)
        for run, chunk in launched.chunked:
            run.filled = chunk.end
            if chunk.last and self._prefixes is not None:
                self._prefixes.keep(run.slot, run.seq.prefix_scope, run.context)  # others may share it now
        return [self._advance(run, token, scores)
                for run, token, scores in zip(launched.outputs, tokens, launched.chosen.scores, strict=True)
                if self._running.get(run.slot) is run]

    def _drop_stopped(self) -> None:
        for run in list(self._running.values()):
            if run.seq.stop_requested is not None:
                self._free_slot(run)
        if any(seq.stop_requested is not None for seq in self._waiting):
            self._waiting = deque(seq for seq in self._waiting if seq.stop_requested is None)

    def _admit(self) -> list[Produced]:
        """Waiting sequences take free slots, lowest first (rows ``0..B-1`` stay dense); one whose copies
        run beside the steps waits for them, and the ones behind it wait too."""
        produced = self._admit_copied()
        while self._copying is None and self._waiting and self._free:
            seq = self._waiting.popleft()
            context, count = seq.context, len(seq.generated)
            if count >= seq.max_new_tokens or len(context) >= self.window:
                produced.append(Produced(seq, None, Finish.LENGTH))  # a resumed sequence with nothing left to do
                continue
            slot = heapq.heappop(self._free)
            run = _Running(seq, slot, context, count)
            copies = self._reuse_prefix(run)
            if copies and self._running and self._copier is not None:
                self._copying = run, self._copier.submit(self._copy, copies)
            else:
                self._copy(copies)
                self._running[slot] = run
        return produced

    def _admit_copied(self) -> list[Produced]:
        """The sequence whose copies ran beside the steps takes its slot once they are done (at once
        where nobody else runs: there is nothing to step meanwhile)."""
        if self._copying is None or (self._running and not self._copying[1].done()):
            return []
        run, copied = self._copying
        self._copying = None
        try:
            copied.result()
        except Exception as exc:
            logger.exception("copying a prefix between slots failed")
            self._prefixes = Prefixes(self.model.slots)  # the copies may have written part of a slot
            heapq.heappush(self._free, run.slot)
            return [Produced(run.seq, None, Finish.ERROR, exc)]
        self._running[run.slot] = run
        if run.seq.stop_requested is not None:  # cancelled meanwhile: it takes no step
            self._free_slot(run)
        return []

    def _copy(self, copies: list[tuple[int, int, int]]) -> None:
        for source, target, length in copies:
            self.model.copy_prefix(source, target, length)

    def _reuse_prefix(self, run: _Running) -> list[tuple[int, int, int]]:
        """Start ``run`` after the longest prefix of its context that a slot holds (copied into its
        own slot from another one), having moved what its slot held aside where the run overwrites
        enough of it (``Prefixes.spare``). The copies (source, target, positions), in order, are the
        caller's to make before the run's first step."""
        prefixes = self._prefixes
        if prefixes is None:
            return []
        slot = run.slot
        copies = []
        reuse = prefixes.best(slot, run.seq.prefix_scope, run.context)
        kept = reuse.length if reuse is not None and reuse.source == slot else 0
        spare = prefixes.spare(slot, (free for free in self._free if reuse is None or free != reuse.source), kept)
        if spare is not None:
            copies.append((slot, spare, prefixes.length(slot)))
            prefixes.move(slot, spare)
        prefixes.forget(slot)
        if reuse is None:
            return copies
        if reuse.source != slot:
            copies.append((reuse.source, slot, reuse.length))
        run.filled = run.seq.cached_tokens = reuse.length
        return copies

    def _chunked(self, decoding: list[_Running]) -> list[tuple[_Running, Chunk]]:
        """This step's prompt chunks, oldest sequence first, within the step's budget."""
        joining = [run for run in self._running.values() if not run.decoding]
        if not joining:
            return []
        rows = max((run.slot for run in decoding), default=-1) + 1  # the step's decoding rows, dummies among them
        budget = self._chunk_budget(len(decoding), len(joining), joining[0].filled, rows)
        chunked = []
        for run in joining:
            if budget <= 0:
                break
            size = min(budget, MAX_CHUNK, len(run.context) - run.filled)
            end = run.filled + size
            chunked.append((run, Chunk(run.slot, run.filled, run.context[run.filled:end], end == len(run.context))))
            budget -= size
        return chunked

    def _chunk_budget(self, decoding: int, joining: int, start: int, rows: int | None = None) -> int:
        """Prompt tokens for this step, the first chunk starting at ``start``: ``decoding`` sequences
        (in ``rows`` rows, dummies among them; default: as many) would wait for them, ``joining`` ones
        wait for their prompts."""
        if not decoding:
            return PREFILL_TOKENS
        price = self._chunk_cost.fit()
        if self._decode_seconds is None or price is None:
            budget = FIRST_CHUNK
        else:
            budget = chunk_budget(self._decode_seconds, price, start, waiting=max(1.0, joining / decoding))
            # at most 1.5 times the last: a fit the machine's noise put off (or a product whose cost
            # jumps at some row count, as oneDNN's do) cannot stall everyone at once
            budget = min(budget, self._last_chunked * 3 // 2)
        # not past the rows the model runs cheapest, where a step's cost jumps (one row more leaves the
        # layers' one call: docs/performance.md, "Continuous batching and chunked prompts"); the price,
        # linear in the tokens, does not see the jump
        room = self.model.one_call_rows - (decoding if rows is None else rows)
        return min(budget, max(room, MIN_CHUNK)) if room > 0 else budget

    def _measure(self, plan: StepPlan, seconds: float) -> None:
        prompt_tokens = sum(len(chunk.tokens) for chunk in plan.chunks)
        if not prompt_tokens:
            self._decode_recent.append(seconds)
            self._decode_seconds = statistics.median(self._decode_recent)
        elif plan.feeds:  # only chunks beside decoding: a prefill alone runs larger, cheaper products
            pairs = sum(len(chunk.tokens) * chunk.end for chunk in plan.chunks)
            self._chunk_cost.add(prompt_tokens, pairs, max(seconds - (self._decode_seconds or 0.0), 1e-6))
            self._last_chunked = max(prompt_tokens, MIN_CHUNK)

    def _advance(self, run: _Running, token: int, scores: Scores | None) -> Produced:
        run.count += 1
        run.next_token = token
        reason = self._finish_reason(run, token)
        if reason is not None:
            self._free_slot(run)
        return Produced(run.seq, token, reason, scores=scores)

    def _finish_reason(self, run: _Running, token: int) -> Finish | None:
        seq = run.seq
        constraint = seq.sampler.constraint
        if token in seq.stop_token_ids or (constraint is not None and constraint.done()):
            return Finish.STOP
        if run.count >= seq.max_new_tokens or len(seq.prompt_ids) + run.count >= self.window:
            return Finish.LENGTH
        return None

    def _fail_all(self, exc: BaseException) -> list[Produced]:
        self._following = None
        if self._copying is not None:  # its slot too may have been written
            run, copied = self._copying
            self._copying = None
            wait([copied])
            self._running[run.slot] = run
        failed = [Produced(run.seq, None, Finish.ERROR, exc) for run in self._running.values()]
        for run in list(self._running.values()):
            self._free_slot(run)
        if self._prefixes is not None:  # a failed step may have written anywhere
            self._prefixes = Prefixes(self.model.slots)
        return failed

    def _free_slot(self, run: _Running) -> None:
        del self._running[run.slot]
        self.model.release(run.slot)
        if self._prefixes is not None:
            self._prefixes.keep(run.slot, run.seq.prefix_scope, run.held)
        heapq.heappush(self._free, run.slot)
