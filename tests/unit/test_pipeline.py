"""The output path without processes: reasoning sections, stop strings, the budget constraint, and
the property resume relies on (replaying stored tokens reaches the state their events left)."""

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import llguidance
import msgspec
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from lmsp_core import wire
from lmsp_core.requests import grammars
from lmsp_core.requests.catalog import SMOLLM2, ReasoningFormat
from lmsp_core.requests.chat import ModelCard, PromptRenderer, to_messages
from lmsp_core.requests.closing import GrammarTokenizer, closing_tokens
from lmsp_core.settings import load_settings
from tests.support import REASONING_TEMPLATE
from workers.engine.sampling import LogitsConstraint
from workers.model import loader
from workers.output.grammar import GrammarConstraint
from workers.output.items import OutputAssembler
from workers.output.pipeline import OutputPipeline
from workers.output.reasoning import ReasoningConstraint, ReasoningParser, Segment
from workers.output.stops import StopFilter

TEMPLATE = ReasoningFormat(opened_by="template")
MODEL = ReasoningFormat(opened_by="model")


@cache
def card() -> ModelCard:
    tokenizer = AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, Path(load_settings().model_cache)))
    return loader.make_card(SMOLLM2, tokenizer, tokenizer.eos_token_id)


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(card().tokenizer_json)


def encode(text: str) -> list[int]:
    ids: list[int] = tokenizer().encode(text, add_special_tokens=False).ids
    return ids


def parse(reasoning: ReasoningFormat | None, text: str, chunk: int) -> list[Segment]:
    parser = ReasoningParser(reasoning)
    segments = [s for i in range(0, len(text), chunk) for s in parser.feed(text[i:i + chunk])] + parser.finish()
    merged: list[Segment] = []
    for segment in segments:  # how the text is cut into deltas does not matter, only the sum
        if merged and segment.kind == merged[-1].kind and segment.kind in ("reasoning", "answer"):
            merged[-1] = Segment(segment.kind, merged[-1].text + segment.text)
        else:
            merged.append(segment)
    return merged


@pytest.mark.parametrize(("reasoning", "text", "expected"), [
    (TEMPLATE, "\n I think </thi so.\n\n</think>\n\nHi </think> x",
     [("reasoning", "I think </thi so."), ("close", ""), ("answer", "Hi </think> x")]),
    (TEMPLATE, "still thinking </th", [("reasoning", "still thinking </th")]),
    (TEMPLATE, "</think>", [("close", "")]),
    (MODEL, "\n<think>\nabc\n</think>\n\n{}", [("open", ""), ("reasoning", "abc"), ("close", ""), ("answer", "{}")]),
    (MODEL, " <thinking", [("answer", " <thinking")]),
    (MODEL, "  <thi", [("answer", "  <thi")]),
    (MODEL, "<think>", [("open", "")]),
    (None, " <think>a</think>", [("answer", " <think>a</think>")]),
])
def test_parser(reasoning: ReasoningFormat | None, text: str, expected: list[tuple[str, str]]) -> None:
    for chunk in (1, 2, 3, 5, len(text)):
        assert parse(reasoning, text, chunk) == [Segment(*item) for item in expected]


@pytest.mark.parametrize(("stops", "text", "expected", "hit"), [
    (["END"], "abc ENx EN END tail", "abc ENx EN ", True),
    (["\n\n", "ab"], "xa\nb\n\nab", "xa\nb", True),
    (["zz", "b"], "aaab zz", "aaa", True),
    (["END"], "no stop E", "no stop E", False),
])
def test_stop_filter(stops: list[str], text: str, expected: str, hit: bool) -> None:
    for chunk in (1, 2, 4, len(text)):
        stop = StopFilter(stops)
        parts = [stop.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)]
        out = "".join(parts) + ("" if stop.hit else stop.flush())
        assert (out, stop.hit) == (expected, hit)
        assert not any(s in part for part in parts for s in stops)


def run_pipeline(tokens: list[int], reasoning: ReasoningFormat | None, stops: list[str], *, replayed: int = 0,
                 known: list[wire.OutputItem] | None = None) -> tuple[list[tuple[str, Any]], list[int], OutputPipeline]:
    """Events of a pipeline fed ``tokens`` (the first ``replayed`` silently, as on resume), and how
    many events had been emitted after each token."""
    events: list[tuple[str, Any]] = []
    pipeline = OutputPipeline(tokenizer(), OutputAssembler("resp_x", "text", known or []), reasoning, stops)
    started = pipeline.start()
    if not replayed:
        events += started
    marks = []
    for index, token in enumerate(tokens):
        if pipeline.stopped:
            break
        caused = pipeline.push(token)
        if index >= replayed:
            events += caused
        marks.append(len(events))
    events += pipeline.finish()[1]
    return events, marks, pipeline


def normalized(events: list[tuple[str, Any]]) -> str:
    """The events with item ids numbered in order of appearance (new items get random ids)."""
    encoded = wire.encoder.encode(events).decode()
    found: dict[str, str] = {}
    return re.sub(r"(rs|msg)_[0-9A-Z]{26}", lambda m: found.setdefault(m.group(0), f"id{len(found)}"), encoded)


@pytest.mark.parametrize(("reasoning", "text", "stops"), [
    (MODEL, "<think>\nLet me see: 2+2 is 4.\n</think>\n\nIt is 4. STOP and more", ["STOP"]),
    (TEMPLATE, "Hmm </thi\nok\n</think>\nDone, done\n\nnot this", ["\n\n"]),
    (None, "Plain text with 😀 emoji END more", ["END"]),
])
def test_replay_reaches_the_stored_state(reasoning: ReasoningFormat | None, text: str, stops: list[str]) -> None:
    tokens = encode(text)
    events, marks, whole = run_pipeline(tokens, reasoning, stops)
    assert whole.stopped
    items = [data.item for name, data in events if name == wire.ITEM_ADDED]
    for cut in range(len(marks)):
        replayed = cut + 1
        known = [data.item for name, data in events[:marks[cut]] if name == wire.ITEM_ADDED]
        resumed, _, pipeline = run_pipeline(tokens, reasoning, stops, replayed=replayed, known=known)
        assert normalized(events[:marks[cut]] + resumed) == normalized(events), f"resumed after token {replayed}"
        assert pipeline.reasoning_tokens == whole.reasoning_tokens
    assert [type(item) for item in items] == ([wire.OutputReasoning, wire.OutputMessage] if reasoning
                                             else [wire.OutputMessage])


def test_reasoning_tokens_end_with_the_marker() -> None:
    tokens = encode("<think>abc</think>\n\nanswer")
    _, _, pipeline = run_pipeline(tokens, MODEL, [])
    assert pipeline.reasoning_tokens == len(encode("<think>abc</think>"))
    _, _, plain = run_pipeline(encode("answer <think>"), MODEL, [])
    assert plain.reasoning_tokens == 0


def allowed_tokens(constraint: LogitsConstraint) -> list[int]:
    """The tokens the constraint allows next (read from the bitmask row it writes)."""
    vocab = tokenizer().get_vocab_size()
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    constraint.allow(row)
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return list(bits.nonzero().flatten().tolist())


def forced(constraint: ReasoningConstraint) -> int | None:
    """The one token the constraint allows next, or None if it allows more than one."""
    allowed = allowed_tokens(constraint)
    return allowed[0] if len(allowed) == 1 else None


def test_budget_forces_the_end_marker() -> None:
    closing = closing_tokens(tokenizer(), TEMPLATE)
    thinking = encode(" one two three four five six")
    constraint = ReasoningConstraint(tokenizer(), TEMPLATE, 4, closing)
    for token in thinking[:4]:
        assert forced(constraint) is None
        constraint.accept(token)
    for token in closing:  # the budget is used up: the section is closed token by token
        assert forced(constraint) == token
        constraint.accept(token)
    assert forced(constraint) is None and not constraint.done()
    # a constraint rebuilt from stored tokens (resume) is in the same state
    rebuilt = ReasoningConstraint(tokenizer(), TEMPLATE, 4, closing, generated=[*thinking[:4], closing[0]])
    assert forced(rebuilt) == closing[1]
    assert forced(ReasoningConstraint(tokenizer(), TEMPLATE, 0, closing)) == closing[0]
    assert forced(ReasoningConstraint(tokenizer(), TEMPLATE, None, closing, generated=thinking)) is None


def test_grammar_applies_after_the_section() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    request = msgspec.convert({"model": "m", "input": [{"type": "message", "role": "user", "content": []}],
                               "response_format": response_format}, wire.ResponseRequest)
    lltokenizer = llguidance.LLTokenizer(card().tokenizer_json, eos_token=card().stop_token_ids)
    for reasoning, text in ((TEMPLATE, "free {text} here</think>\n\n"), (MODEL, "\n<think>free</think>"),
                            (MODEL, "")):
        grammar = grammars.generation_grammar(request, reasoning=reasoning)
        assert grammar is not None
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        assert matcher.consume_tokens(encode(text + '{"n":1}')), (text, matcher.get_error())
        assert matcher.is_accepting()
        assert not llguidance.LLMatcher(lltokenizer, grammar, log_level=0).consume_tokens(encode(text + "no json"))
    # the budget's forced tokens follow the grammar, then the grammar decides
    closing = closing_tokens(tokenizer(), TEMPLATE)
    grammar = grammars.generation_grammar(request, reasoning=TEMPLATE)
    assert grammar is not None
    grammar_constraint = GrammarConstraint(GrammarTokenizer(lltokenizer), grammar)
    constraint = ReasoningConstraint(tokenizer(), TEMPLATE, 2, closing, grammar_constraint)
    for token in [*encode(" a b")[:2], *closing]:
        constraint.accept(token)
    allowed = {tokenizer().decode([t]) for t in allowed_tokens(constraint)}
    assert allowed and all(text.lstrip(" \n").startswith("{") or not text.strip() for text in allowed)


def test_reasoning_items_become_reasoning_content() -> None:
    items = msgspec.convert([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q1"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "old thought"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A1"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q2"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "call it"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ], list[wire.InputItem])
    messages = to_messages(items)
    assert [m.get("reasoning_content") for m in messages] == [None, "old thought", None, "call it", None]
    rendered = PromptRenderer(msgspec.structs.replace(card(), chat_template=REASONING_TEMPLATE)).render(items)
    assert "<think>\nold thought\n</think>\n\nA1" in rendered and "dropped" not in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\n")
    assert "thought" not in PromptRenderer(card()).render(items)  # SmolLM2's template has no reasoning


def test_service_opened_section_is_part_of_the_prompt() -> None:
    spec = msgspec.structs.replace(SMOLLM2, reasoning=ReasoningFormat(opened_by="service"))
    hf = AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, Path(load_settings().model_cache)))
    service_card = loader.make_card(spec, hf, hf.eos_token_id)
    items = msgspec.convert([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                            list[wire.InputItem])
    assert PromptRenderer(service_card).render(items) == PromptRenderer(card()).render(items) + "<think>\n"
    assert json.loads(json.dumps(service_card.prompt_suffix)) == "<think>\n"


def entry(token: int) -> wire.TokenLogprob:
    text = tokenizer().decode([token], skip_special_tokens=False)
    return wire.TokenLogprob(token=text, logprob=-float(token), bytes=list(text.encode()), top_logprobs=[])


@pytest.mark.parametrize(("reasoning", "text", "stops", "answer"), [
    (MODEL, "<think>\nLet me see: 2+2 is 4.\n</think>\n\nIt is 4. STOP and more", ["STOP"], "It is 4. "),
    (None, "Plain text with 😀 emoji END more", ["END"], "Plain text with 😀 emoji "),
    (None, "Plain text with 😀 emoji", [], "Plain text with 😀 emoji"),
])
def test_log_probabilities_go_with_the_deltas_of_their_text(reasoning: ReasoningFormat | None, text: str,
                                                            stops: list[str], answer: str) -> None:
    """Each answer token's entry goes out once, in order, with the delta that carries (or completes)
    its text; the reasoning section's tokens have none; the message's part holds them all."""
    pipeline = OutputPipeline(tokenizer(), OutputAssembler("resp_x", "text", logprobs=True), reasoning, stops)
    events = pipeline.start()
    for token in encode(text):
        if pipeline.stopped:
            break
        events += pipeline.push(token, entry(token))
    items, closing = pipeline.finish()
    events += closing
    deltas = [data for name, data in events if name == wire.TEXT_DELTA]
    sent = [item for delta in deltas for item in delta.logprobs or ()]
    ids = [-int(item.logprob) for item in sent]
    spelled = tokenizer().decode(ids)
    assert "".join(delta.delta for delta in deltas) == answer
    assert spelled.lstrip().startswith(answer) and "think" not in spelled  # the blank line after the section
    tokens = encode(text)
    assert any(tokens[start:start + len(ids)] == ids for start in range(len(tokens)))  # consecutive, once each
    message = items[-1]
    assert isinstance(message, wire.OutputMessage) and message.content[0].logprobs == sent


def test_a_resumed_run_gives_the_entries_the_whole_run_gives_after_its_cut() -> None:
    """Replaying stored tokens (no entries: theirs are stored) through the section's end, then going on
    with entries, sends those of the whole run's tokens after the cut."""
    tokens = encode("<think>\nLet me see: 2+2 is 4.\n</think>\n\nIt is 4. STOP and more")

    def sent(replayed: int) -> list[int]:
        """The positions of the tokens whose entries the deltas carried (an entry's value: -position)."""
        pipeline = OutputPipeline(tokenizer(), OutputAssembler("resp_x", "text", logprobs=True), MODEL, ["STOP"])
        pipeline.replay(tokens[:replayed])
        events = []
        for position in range(replayed, len(tokens)):
            if pipeline.stopped:
                break
            events += pipeline.push(tokens[position], msgspec.structs.replace(entry(tokens[position]),
                                                                              logprob=-float(position)))
        events += pipeline.finish()[1]
        return [-int(item.logprob) for name, data in events if name == wire.TEXT_DELTA for item in data.logprobs or ()]

    whole = sent(0)
    for cut in range(1, len(tokens)):
        assert sent(cut) == [position for position in whole if position >= cut], f"resumed after token {cut}"
