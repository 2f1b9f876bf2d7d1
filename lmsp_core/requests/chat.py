"""Prompt rendering: LMSP input items -> chat messages -> the model's chat template -> token ids.

The API and the workers render with this one module, from the model card a worker publishes
(tokenizer + template), so the API's context-length check counts exactly the tokens the worker
feeds the model. The Jinja environment mirrors the one transformers uses for chat templates.
"""

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from lmsp_core import wire
from lmsp_core.requests.grammars import CALL_CLOSE, CALL_OPEN


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker publishes about a loaded model so other processes can tokenize for it."""

    model_id: str
    chat_template: str
    tokenizer_json: str
    bos_token: str | None = None
    eos_token: str | None = None
    # token ids that end generation
    stop_token_ids: list[int]
    # text appended to every rendered prompt (a reasoning section the service opens itself)
    prompt_suffix: str = ""


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


def _call_text(call: wire.FunctionCall) -> str:
    return f'{CALL_OPEN}{{"name": {json.dumps(call.name)}, "arguments": {_arguments_json(call)}}}{CALL_CLOSE}'


def _arguments_json(call: wire.FunctionCall) -> str:
    try:
        return json.dumps(json.loads(call.arguments), ensure_ascii=False)
    except ValueError:  # the client sent back arguments that are not JSON: pass them on as a string
        return json.dumps(call.arguments, ensure_ascii=False)


def _native_call(call: wire.FunctionCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def to_messages(items: Sequence[wire.InputItem], native_tools: bool = False) -> list[dict[str, Any]]:
    """LMSP input items as the chat-message dicts that chat templates expect.

    Consecutive function calls become one assistant turn; a function call's output becomes a
    ``tool`` message. The summaries of reasoning items become the ``reasoning_content`` of the
    assistant turn that follows them (the key Qwen3-style templates read; templates that do not
    read it drop the reasoning); reasoning that no assistant turn follows is dropped.
    """
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for item in items:
        if isinstance(item, wire.Reasoning):
            reasoning += [part.text for part in item.summary]
            continue
        if isinstance(item, wire.Message):
            messages.append({"role": item.role, "content": message_text(item.content)})
        elif isinstance(item, wire.FunctionCall):
            last = messages[-1] if messages else None
            if reasoning or last is None or last["role"] != "assistant" or not last.get("_calls"):
                last = {"role": "assistant", "content": "", "_calls": True}
                messages.append(last)
            if native_tools:
                last.setdefault("tool_calls", []).append(_native_call(item))
            else:
                last["content"] += ("\n" if last["content"] else "") + _call_text(item)
        elif isinstance(item, wire.FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "\n\n".join(reasoning)
        reasoning = []
    for message in messages:
        message.pop("_calls", None)
    return messages


def tools_prompt(tools: Sequence[wire.FunctionTool]) -> str:
    """How the service tells a model whose template knows no tools about them (service format)."""
    listing = "\n".join(json.dumps(_tool_dict(tool)["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call functions. These are their JSON schemas:\n<tools>\n" + listing + "\n</tools>\n"
        "To call a function, answer with one block per call, exactly like this:\n"
        f'{CALL_OPEN}{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}{CALL_CLOSE}\n'
        "The results come back in messages from the tool role."
    )


def _tool_dict(tool: wire.FunctionTool) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def with_tools_prompt(messages: list[dict[str, Any]], tools: Sequence[wire.FunctionTool]) -> list[dict[str, Any]]:
    block = tools_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


class PromptRenderer:
    """Renders and tokenizes prompts for one model card."""

    def __init__(self, card: ModelCard) -> None:
        self.card = card
        self.tokenizer = Tokenizer.from_str(card.tokenizer_json)
        environment = _environment()
        self._template = environment.from_string(card.chat_template)
        # a template that reads `tools` renders tool definitions, calls and results itself
        self.native_tools = "tools" in jinja2.meta.find_undeclared_variables(environment.parse(card.chat_template))

    def render(self, items: Sequence[wire.InputItem], tools: Sequence[wire.FunctionTool] | None = None) -> str:
        messages = to_messages(items, self.native_tools)
        context: dict[str, Any] = {}
        if tools and self.native_tools:
            context["tools"] = [_tool_dict(tool) for tool in tools]
        elif tools:
            messages = with_tools_prompt(messages, tools)
        return self._template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.card.bos_token or "",
            eos_token=self.card.eos_token or "",
            **context,
        ) + self.card.prompt_suffix

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def prompt_ids(self, request: wire.ResponseRequest, items: Sequence[wire.InputItem] | None = None) -> list[int]:
        """The prompt of a request; ``items`` replaces its input (a continued conversation)."""
        return self.encode(self.render(request.input if items is None else items, request.tools))
