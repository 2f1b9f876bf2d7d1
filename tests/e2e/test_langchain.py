"""LangChain's OpenAI chat model as a real client of ``/v1/chat/completions``: structured output by
function calling (a forced call with ``parallel_tool_calls: false``) and tools bound with
``parallel_tool_calls=False``, invoked and streamed, against a real API and tiny-random worker.
"""

from collections.abc import AsyncIterator
from typing import Literal

import openai
import pydantic
import pytest_asyncio
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI

from tests.support import Api, Worker

MODEL = "tiny-random"
TWO_CITIES = "What is the weather in Paris and in Lima?"


class Forecast(pydantic.BaseModel):
    """A forecast for one city."""

    city: Literal["Paris", "Lima"]
    sunny: bool


# as an OpenAI tool: the prompt for which tiny-random calls it three times when it may
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"],
                   "additionalProperties": False}}}


@pytest_asyncio.fixture
async def chat(api: Api, tiny_worker: Worker) -> AsyncIterator[ChatOpenAI]:
    # its own HTTP clients, closed here (LangChain's defaults are shared and never closed)
    with openai.DefaultHttpxClient() as http:
        async with openai.DefaultAsyncHttpxClient() as http_async:
            yield ChatOpenAI(model=MODEL, base_url=f"{api.url}/v1", api_key=pydantic.SecretStr("unused"),
                             max_retries=0, timeout=120, max_completion_tokens=120, http_async_client=http_async,
                             http_client=http)


async def test_structured_output_by_function_calling(chat: ChatOpenAI) -> None:
    structured = chat.with_structured_output(Forecast, method="function_calling")
    forecast = await structured.ainvoke(TWO_CITIES)
    assert isinstance(forecast, Forecast) and forecast.city in ("Paris", "Lima")
    raw = await chat.with_structured_output(Forecast, method="function_calling", include_raw=True).ainvoke(TWO_CITIES)
    assert raw["parsing_error"] is None and isinstance(raw["raw"], AIMessage) and len(raw["raw"].tool_calls) == 1


async def test_tools_without_parallel_calls(chat: ChatOpenAI) -> None:
    free = chat.bind_tools([GET_WEATHER], tool_choice="required", parallel_tool_calls=True)
    several = await free.ainvoke(TWO_CITIES)
    assert isinstance(several, AIMessage) and len(several.tool_calls) > 1
    single = chat.bind_tools([GET_WEATHER], tool_choice="required", parallel_tool_calls=False)
    answer = await single.ainvoke(TWO_CITIES)
    assert isinstance(answer, AIMessage) and [call["name"] for call in answer.tool_calls] == ["get_weather"]
    assert answer.tool_calls[0]["args"]["city"] in ("Paris", "Lima") and not answer.content
    # streamed: the chunks add up to the same single call
    chunks = [chunk async for chunk in single.astream(TWO_CITIES)]
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert isinstance(merged, AIMessageChunk)
    assert [(call["name"], call["args"]) for call in merged.tool_calls] == [
        (call["name"], call["args"]) for call in answer.tool_calls]
    assert not merged.content
