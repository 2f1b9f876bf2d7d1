"""Constrained output that completes within its token budget (lmsp_core.requests.closing, workers.output.grammar), and
the model cards the API reads from files (lmsp_core.requests.modelfiles).

The constraint is driven here by a seeded random choice among the tokens its mask allows: a harsher
model than any trained one (it opens strings, keys and arrays at every turn), with no model to run.
"""

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import msgspec
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from lmsp_core import wire
from lmsp_core.requests import grammars, modelfiles
from lmsp_core.requests.catalog import SMOLLM2, TINY_RANDOM, ModelSpec, ReasoningFormat
from lmsp_core.requests.chat import ModelCard
from lmsp_core.requests.closing import GrammarTokenizer, closing_tokens, output_tokens_needed
from lmsp_core.settings import load_settings
from tests.support import PARAMETERS, REASONING_TEMPLATE, SCHEMAS, TOOLS, user_input
from workers.model import loader
from workers.output.grammar import GrammarConstraint
from workers.output.reasoning import ReasoningConstraint

CACHE = Path(load_settings().model_cache)
# a harder tool than those of TOOLS (tests/support.py): a lower bound, a pattern and a minimum number of items
PATTERNED = {"type": "function", "name": "mail", "parameters": {
    "type": "object", "required": ["n", "to"],
    "properties": {"n": {"type": "integer", "minimum": 10},
                   "to": {"type": "array", "minItems": 2,
                          "items": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
                   "note": {"type": "string", "minLength": 3}}}}


@cache
def card() -> ModelCard:
    return loader.make_card(TINY_RANDOM, AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, CACHE)), None)


@cache
def tokenizer() -> GrammarTokenizer:
    return GrammarTokenizer.build(card().tokenizer_json, card().stop_token_ids)


def request(**fields: Any) -> wire.ResponseRequest:
    return msgspec.convert({"model": "tiny-random", "input": user_input("x"), **fields}, wire.ResponseRequest)


def call_request(tools: list[dict[str, Any]]) -> wire.ResponseRequest:
    return request(tools=tools, tool_choice="required")


def schema_request(schema: dict[str, Any]) -> wire.ResponseRequest:
    return request(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


CASES = [("call", call_request(TOOLS[:1])), ("any call", call_request(TOOLS)),
         ("patterned call", call_request([PATTERNED])),
         *((f"schema {i}", schema_request(schema)) for i, schema in enumerate(SCHEMAS))]


def grammar_of(req: wire.ResponseRequest, reasoning: ReasoningFormat | None = None) -> str:
    grammar = grammars.generation_grammar(req, reasoning=reasoning)
    assert grammar is not None
    return grammar


def allowed(constraint: GrammarConstraint | ReasoningConstraint) -> list[int]:
    vocab = tokenizer().ll.vocab_size
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    constraint.allow(row)
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return list(bits.nonzero().flatten().tolist())


def run(constraint: GrammarConstraint | ReasoningConstraint, budget: int, rng: random.Random) -> list[int]:
    """Tokens chosen at random among those allowed, as the engine takes them, until the budget is used up,
    the grammar is complete or end-of-sequence is taken."""
    tokens: list[int] = []
    while len(tokens) < budget and not constraint.done():
        tokens.append(constraint.accept(rng.choice(allowed(constraint))))
        if tokens[-1] in card().stop_token_ids:
            break
    return tokens


def checked(req: wire.ResponseRequest, text: str) -> None:
    """The text is one complete call or JSON document, valid against its schema."""
    if req.tools:
        assert text.startswith(grammars.CALL_OPEN) and text.endswith(grammars.CALL_CLOSE), text
        call = json.loads(text.removeprefix(grammars.CALL_OPEN).removesuffix(grammars.CALL_CLOSE))
        jsonschema.validate(call["arguments"], PARAMETERS.get(call["name"], PATTERNED["parameters"]))
    else:
        assert isinstance(req.response_format, wire.JsonSchemaFormat)
        jsonschema.validate(json.loads(text), req.response_format.json_schema.schema)


def completed(tokens: list[int]) -> str:
    return str(tokenizer().ll.decode_str([t for t in tokens if t not in card().stop_token_ids]))


@pytest.mark.parametrize(("case", "req"), CASES, ids=[case for case, _ in CASES])
def test_the_plan_from_the_start_is_a_valid_output(case: str, req: wire.ResponseRequest) -> None:
    grammar = grammar_of(req)
    matcher = llguidance.LLMatcher(tokenizer().ll, grammar, log_level=0)
    plan = tokenizer().plan(matcher)
    assert plan is not None and len(plan) == output_tokens_needed(tokenizer(), grammar)
    assert tokenizer().plan(matcher) == plan  # the matcher is left as it was, and the plan is deterministic
    assert matcher.consume_tokens(plan) and matcher.is_stopped()  # a call or an object ends the grammar
    checked(req, completed(plan))


@pytest.mark.parametrize(("case", "req"), CASES, ids=[case for case, _ in CASES])
def test_outputs_complete_within_any_budget_they_fit(case: str, req: wire.ResponseRequest) -> None:
    grammar = grammar_of(req)
    needed = output_tokens_needed(tokenizer(), grammar)
    assert needed is not None
    rng = random.Random(case)
    for budget in (needed, needed + 1, needed + 5, 64, 300):
        for _ in range(3):
            constraint = GrammarConstraint(tokenizer(), grammar, budget=max(budget, needed))
            tokens = run(constraint, max(budget, needed), rng)
            assert constraint.done() or tokens[-1] in card().stop_token_ids, (budget, completed(tokens))
            checked(req, completed(tokens))


def test_a_resumed_constraint_keeps_the_plans_of_the_first_run() -> None:
    req = call_request([PATTERNED])
    grammar = grammar_of(req)
    rng = random.Random(7)
    for budget in (45, 60, 400):
        first = GrammarConstraint(tokenizer(), grammar, budget=budget)
        tokens: list[int] = []
        forced: list[bool] = []
        while not first.done() and len(tokens) < budget:
            forced.append(first.closing)
            tokens.append(first.accept(rng.choice(allowed(first))))
        for cut in range(1, len(tokens), 7):
            resumed = GrammarConstraint(tokenizer(), grammar, tokens[:cut], budget=budget)
            assert resumed.closing == forced[cut], (budget, cut)
            follow = tokens[cut] if forced[cut] else None
            if follow is not None:  # forcing: the same token is the only one allowed
                assert allowed(resumed) == [follow]


def test_free_text_is_not_ended_early_and_a_call_too_long_for_the_budget_is_not_begun() -> None:
    text = GrammarConstraint(tokenizer(), grammar_of(request(tools=TOOLS, tool_choice="none")), budget=2)
    assert text.needed == 0
    text.accept(tokenizer().ll.tokenize_str("Hello")[0])
    assert not text.closing and len(allowed(text)) > 1000  # the last token is the model's choice
    auto = GrammarConstraint(tokenizer(), grammar_of(request(tools=TOOLS)), budget=8)
    assert auto.needed == 0
    taken = []
    for token in tokenizer().ll.tokenize_str('<tool_call>{"name": "add"'):
        taken.append(auto.accept(token))
        if auto.done():
            break
    assert taken[-1] == tokenizer().eos and len(taken) < 8  # the output ends, as text, instead
    assert completed(taken).startswith("<tool_call") and not completed(taken).startswith(grammars.CALL_OPEN)


def test_a_grammar_without_a_budget_is_never_forced() -> None:
    constraint = GrammarConstraint(tokenizer(), grammar_of(call_request(TOOLS[:1])))
    assert not constraint.closing and constraint.needed is None


def test_the_reasoning_section_closes_in_time_for_the_answer() -> None:
    reasoning = ReasoningFormat(opened_by="template")
    text_tokenizer = Tokenizer.from_str(card().tokenizer_json)
    closing = closing_tokens(text_tokenizer, reasoning)
    req = schema_request(SCHEMAS[0])
    grammar = grammar_of(req, reasoning)
    needed = output_tokens_needed(tokenizer(), grammar, [closing])
    assert needed is not None and needed > len(closing)
    rng = random.Random(3)
    for budget in (needed, needed + 3, 80):
        grammar_constraint = GrammarConstraint(tokenizer(), grammar, budget=budget, closers=[closing])
        constraint = ReasoningConstraint(text_tokenizer, reasoning, None, closing, grammar_constraint)
        tokens = run(constraint, budget, rng)
        assert constraint.done(), budget
        text = completed(tokens)
        assert reasoning.end in text
        checked(req, text.split(reasoning.end, 1)[1].strip())


# --- model cards from files ----------------------------------------------------------------------------


def test_the_api_reads_the_card_a_worker_would_publish() -> None:
    reasoning = msgspec.structs.replace(TINY_RANDOM, id="r", chat_template=REASONING_TEMPLATE,
                                        reasoning=ReasoningFormat(opened_by="service"))
    for spec in (TINY_RANDOM, reasoning, msgspec.structs.replace(SMOLLM2, compile=False)):
        worker = loader.make_card(spec, AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, CACHE)),
                                  2 if spec.source.startswith("gguf") else None)
        files = modelfiles.card_from_files(spec, CACHE)
        assert files == worker, spec.id


def test_a_gguf_vocabulary_tokenizes_as_the_converted_model() -> None:
    found = modelfiles.card_from_files(SMOLLM2, Path("/nonexistent"))  # nothing converted: the GGUF itself
    converted = modelfiles.card_from_files(SMOLLM2, CACHE)
    assert found is not None and converted is not None
    assert msgspec.structs.replace(found, tokenizer_json="") == msgspec.structs.replace(converted, tokenizer_json="")
    ours, theirs = Tokenizer.from_str(found.tokenizer_json), Tokenizer.from_str(converted.tokenizer_json)
    texts = ["Hello world", "  two spaces\n\n\ttab", "<|im_start|>user\nHi<|im_end|>\n", "naïve café 日本語 🤖",
             "def f(x):\n    return x**2  # note", '<tool_call>{"name": "f"}</tool_call>', "12345 3.14159 1e10",
             "'s 're don't", "a" * 40, "\u00a0\u2028 odd spaces"]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False).ids


def test_no_files_no_card(tmp_path: Path) -> None:
    assert modelfiles.card_from_files(ModelSpec(id="x", source=f"hf-dir:{tmp_path}", context_window=64,
                                                max_output_tokens=8, capabilities=[]), tmp_path) is None


def test_the_api_reads_cards_without_torch() -> None:
    import subprocess
    import sys

    script = ("import sys; from pathlib import Path; import api.http.app; from lmsp_core.requests import modelfiles; "
              "from lmsp_core.requests.catalog import SMOLLM2; "
              "assert modelfiles.card_from_files(SMOLLM2, Path('/nonexistent')) is not None; "
              "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
