"""Grammar-constrained decoding with llguidance: one matcher per sequence, whose mask of allowed
tokens the engine applies to the sequence's row in each step (see ``sampling.LogitsConstraint``).

With a token budget the constraint also keeps a closing plan (``lmsp_core.requests.closing``): the tokens
that complete the grammar from where the sequence stands. Once the tokens left are no more than the
plan, it forces the plan; and it never takes a token after which the plan would no longer fit (it
takes the plan's next token instead), so the output is complete when the budget runs out.
"""

import logging
from collections.abc import Sequence

import llguidance
import torch

from lmsp_core.requests.chat import ModelCard
from lmsp_core.requests.closing import MAX_PLAN, GrammarTokenizer
from workers.engine.sampling import allow_only

logger = logging.getLogger(__name__)


def tokenizer_for(card: ModelCard) -> GrammarTokenizer:
    """llguidance's view of the model's tokenizer (about a second to build: keep one per model)."""
    return GrammarTokenizer.build(card.tokenizer_json, card.stop_token_ids)


class GrammarConstraint:
    """Masks every token the grammar does not allow next; ``done`` once the grammar is complete.

    ``budget`` is the sequence's token budget (None: no plan is kept); ``generated``, tokens that
    a resumed sequence already has (they count against the budget); ``closers``, what completes a
    reasoning section (``GrammarTokenizer.plan``). The plan is kept from the point where at most
    ``MAX_PLAN + 1`` tokens are left: any plan the planner finds fits then, so earlier tokens need no
    check (and cost nothing more than the mask)."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, generated: Sequence[int] = (), *,
                 budget: int | None = None, closers: Sequence[Sequence[int]] = ()) -> None:
        self._tokenizer = tokenizer
        self._matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
        self._words = (tokenizer.ll.vocab_size + 31) // 32
        if self._matcher.is_error():
            raise ValueError(self._matcher.get_error())
        self._budget = budget
        self._closers = [list(closer) for closer in closers]
        self._count = 0
        plan = tokenizer.plan(self._matcher, self._closers) if budget is not None else None
        self.needed = None if plan is None else len(plan)  # tokens of the shortest output (from the start)
        self._watching = plan is not None  # False: no plan is kept (no budget, or the planner found none)
        self._plan: list[int] | None = None  # None while more tokens are left than any plan needs
        self._pending: tuple[int, list[int] | None] | None = None  # a token tried by ``_fits``, its plan
        self._watch(plan)
        for token in generated:
            if not self._advance(token):
                raise ValueError(f"stored tokens do not follow the grammar: {self._matcher.get_error()}")

    @property
    def closing(self) -> bool:
        """Whether the plan is being forced (the tokens left are no more than it needs)."""
        return bool(self._plan) and len(self._plan or ()) >= self._left()

    def allow(self, bitmask: torch.Tensor) -> None:
        if self._plan and self.closing:
            allow_only(bitmask, self._plan[0])
            return
        bitmask[self._words:].zero_()  # the model's rows beyond the tokenizer's vocabulary
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), self._words * 4)

    def accept(self, token: int) -> int:
        plan = self._plan
        if plan is not None and (not plan or token != plan[0]) and not self._fits(token):
            # the model's choice leaves too little room to complete: the plan's next token instead, or
            # the end where the output may end here already
            token = plan[0] if plan else self._tokenizer.eos
        if not self._advance(token):
            logger.error("a token the grammar did not allow was generated: %s", self._matcher.get_error())
        return token

    def done(self) -> bool:
        return bool(self._matcher.is_stopped())

    def _left(self) -> int:
        return (self._budget or 0) - self._count

    def _watch(self, plan: list[int] | None = None) -> None:
        """Start keeping the plan once at most ``MAX_PLAN + 1`` tokens are left (``plan``: the plan of
        the current state, if known)."""
        if self._watching and self._plan is None and self._left() <= MAX_PLAN + 1:
            self._plan = plan if plan is not None else self._tokenizer.plan(self._matcher, self._closers)
            self._watching = self._plan is not None

    def _fits(self, token: int) -> bool:
        """Whether a plan from after ``token`` fits in the tokens left then (remembered for ``_advance``)."""
        left = self._left() - 1
        if not self._matcher.try_consume_tokens([token]):
            return False
        plan = self._replan(left)
        self._matcher.rollback(1)
        self._pending = (token, plan)
        return plan is not None and len(plan) <= left

    def _advance(self, token: int) -> bool:
        """Take ``token`` and bring the plan up to date: deterministic, so a resumed sequence that
        replays its tokens has the plans the first run had."""
        pending, self._pending = self._pending, None
        self._count += 1
        if not self._matcher.consume_token(token):
            return False
        if self._plan is None:
            self._watch()
        elif self._plan and token == self._plan[0]:
            self._plan = self._plan[1:]
        else:
            self._plan = pending[1] if pending is not None and pending[0] == token else self._replan(self._left())
            self._watching = self._plan is not None
        return True

    def _replan(self, left: int) -> list[int] | None:
        """The plan after a token that is not the plan's (``left`` tokens left then): the old one if it
        still completes the grammar and fits, else a new one (the shorter of the two if both do)."""
        old = self._plan if self._plan and self._tokenizer.closes(self._matcher, self._plan) else None
        if old is not None and len(old) <= left:
            return old
        new = self._tokenizer.plan(self._matcher, self._closers)
        if old is None or (new is not None and len(new) < len(old)):
            return new
        return old
