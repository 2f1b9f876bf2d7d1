"""Request bodies as the tests send them, and output items carried into the next turn."""

from typing import Any


def user_input(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def body(model: str = "tiny-random", text: str = "Hello there", **fields: Any) -> dict[str, Any]:
    return {"model": model, "input": user_input(text), **fields}


def as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the input items that carry them into the next turn."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": item["content"], "id": item["id"]})
        else:
            items.append(item)
    return items
