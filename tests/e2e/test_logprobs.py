"""Log probabilities end to end, with the official ``openai`` package on both OpenAI routes (streamed
and not) and with the LMSP extension ``x-logprobs``: the values are the model's own log-softmax, as
transformers computes it from the same context in this process."""

from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis
import torch
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from lmsp_core import wire
from lmsp_core.requests.catalog import TINY_RANDOM
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import load_settings
from lmsp_core.store import registry
from tests.support import user_input
from workers.model import loader

MODEL = "tiny-random"
PROMPT = "Name three colours."
TOKENS = 8
INCLUDE = ["message.output_text.logprobs"]


def check_entries(entries: list[Any], text: str, top: int) -> None:
    """One entry a generated token: their bytes spell the text, each has ``top`` alternatives, most
    likely first, and the greedy choice is the most likely."""
    assert b"".join(bytes(entry.bytes) for entry in entries) == text.encode()
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == top
        values = [other.logprob for other in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:
            assert entry.logprob == pytest.approx(values[0], abs=1e-6)


def pairs(entries: list[Any]) -> list[tuple[str, float]]:
    return [(entry.token, round(entry.logprob, 4)) for entry in entries]


async def test_chat_logprobs_streamed_and_not(sdk: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    completion = ChatCompletion.model_validate((await sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, logprobs=True, top_logprobs=3)).to_dict())
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert completion.usage is not None and len(choice.logprobs.content) == completion.usage.completion_tokens
    check_entries(choice.logprobs.content, choice.message.content or "", 3)
    stream = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, logprobs=True,
                                               top_logprobs=3, stream=True)
    chunks = [ChatCompletionChunk.model_validate(chunk.to_dict()) async for chunk in stream]
    streamed = [entry for chunk in chunks for choice_ in chunk.choices if choice_.logprobs is not None
                for entry in choice_.logprobs.content or ()]
    assert pairs(streamed) == pairs(choice.logprobs.content)  # greedy: the same tokens, the same values
    plain = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS)
    assert plain.choices[0].logprobs is None


async def test_responses_logprobs_streamed_and_not(sdk: openai.AsyncOpenAI) -> None:
    response = Response.model_validate((await sdk.responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=TOKENS, include=INCLUDE, top_logprobs=2)).to_dict())
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    check_entries(part.logprobs, part.text, 2)
    assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens
    events = [event async for event in await sdk.responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=TOKENS, include=INCLUDE, top_logprobs=2, stream=True)]
    deltas = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert pairs(deltas) == pairs(done.logprobs) == pairs(part.logprobs)
    without = await sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=TOKENS)
    assert without.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    only_include = await sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=TOKENS, include=INCLUDE)
    entries = only_include.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert entries and all(entry.top_logprobs == [] for entry in entries)


async def test_bad_logprob_requests_are_400s(sdk: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    with pytest.raises(openai.BadRequestError) as chat:
        await sdk.chat.completions.create(model=MODEL, messages=messages, top_logprobs=3)
    assert chat.value.code == "invalid_value" and chat.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as responses:
        await sdk.responses.create(model=MODEL, input=PROMPT, top_logprobs=21, include=INCLUDE)
    assert responses.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as include:
        await sdk.responses.create(model=MODEL, input=PROMPT, include=["reasoning.encrypted_content"])
    assert include.value.param == "include"


async def test_lmsp_logprobs_are_the_models_log_softmax(client: httpx.AsyncClient, redis: aioredis.Redis) -> None:
    """``x-logprobs`` on the LMSP route: every generated token's entry holds the log-softmax that
    transformers computes for it, and its alternatives, from the prompt the worker rendered."""
    items = user_input(PROMPT)
    reply = await client.post("/lmsp/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": TOKENS,
                                                            "extensions": {"x-logprobs": 4}})
    assert reply.status_code == 200, reply.text
    part = msgspec.convert(reply.json()["output"][0], wire.OutputMessage).content[0]
    assert isinstance(part.logprobs, list) and len(part.logprobs) == TOKENS
    card = await registry.load_card(redis, MODEL)
    assert card is not None
    renderer = PromptRenderer(card)
    context = renderer.prompt_ids(msgspec.convert({"model": MODEL, "input": items}, wire.ResponseRequest))
    model = loader.load(TINY_RANDOM, Path(load_settings().model_cache)).model
    for entry in part.logprobs:
        with torch.inference_mode():
            expected = torch.log_softmax(model(torch.tensor([context])).logits[0, -1].float(), dim=-1)
        values, ids = expected.topk(4)
        assert entry.logprob == pytest.approx(float(values[0]), abs=1e-3)  # greedy: the most likely
        assert [other.logprob for other in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-3)
        assert entry.bytes == list(renderer.tokenizer.decode([int(ids[0])], skip_special_tokens=False).encode()) \
            or "\\x" in entry.token
        context.append(int(ids[0]))
