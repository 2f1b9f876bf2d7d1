"""OpenAI batches through the official client (tests/e2e/test_batches.py, test_webhooks.py)."""

import asyncio
import json
import time
from typing import Any

import openai

CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, text: str, tokens: int = 4, model: str = "tiny-random") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                     "temperature": 0}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def run_batch(sdk: openai.AsyncOpenAI, lines: list[Any], window: str = "24h",
                    endpoint: str = CHAT) -> tuple[Any, Any]:
    source = await sdk.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=source.id, endpoint=endpoint,  # type: ignore[arg-type]
                                     completion_window=window)  # type: ignore[arg-type]
    return source, batch


async def until_final(sdk: openai.AsyncOpenAI, batch_id: str, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)


async def batch_lines(sdk: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await sdk.files.content(file_id)
    return [json.loads(line) for line in content.content.splitlines() if line.strip()]
