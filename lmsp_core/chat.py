"""Prompt rendering: LMSP input items -> chat messages -> the model's chat template -> token ids.

The API and the workers render with this one module, from the model card a worker publishes
(tokenizer + template), so the API's context-length check counts exactly the tokens the worker
feeds the model. The Jinja environment mirrors the one transformers uses for chat templates.
"""

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from lmsp_core import wire
from lmsp_core.errors import InvalidRequest


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker publishes about a loaded model so other processes can tokenize for it."""

    model_id: str
    chat_template: str
    tokenizer_json: str
    bos_token: str | None = None
    eos_token: str | None = None
    # token ids that end generation
    stop_token_ids: list[int]


def card_digest(card: ModelCard) -> str:
    return hashlib.sha256(msgspec.json.encode(card)).hexdigest()[:16]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def message_text(parts: Sequence[wire.ContentPart]) -> str:
    """The text of a message's parts, concatenated in order (only text parts reach here)."""
    return "".join(part.text for part in parts if isinstance(part, wire.TEXT_PARTS))


def to_messages(items: Sequence[wire.InputItem]) -> list[dict[str, Any]]:
    """LMSP input items as the chat-message dicts that chat templates expect."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, wire.Message):
            messages.append({"role": item.role, "content": message_text(item.content)})
        elif isinstance(item, wire.FunctionCall | wire.FunctionCallOutput | wire.Reasoning):
            raise InvalidRequest(f"Input items of type {type(item).__name__} are not supported by this model.")
    return messages


class PromptRenderer:
    """Renders and tokenizes prompts for one model card."""

    def __init__(self, card: ModelCard) -> None:
        self.card = card
        self.tokenizer = Tokenizer.from_str(card.tokenizer_json)
        self._template = _environment().from_string(card.chat_template)

    def render(self, items: Sequence[wire.InputItem]) -> str:
        return self._template.render(
            messages=to_messages(items),
            add_generation_prompt=True,
            bos_token=self.card.bos_token or "",
            eos_token=self.card.eos_token or "",
        )

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def prompt_ids(self, items: Sequence[wire.InputItem]) -> list[int]:
        return self.encode(self.render(items))

    @cached_property
    def vocab_size(self) -> int:
        size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return size
