"""The OpenAI compatibility layer: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/responses``.

An adapter, nothing more: requests are translated into LMSP requests and go through the same
submit path, and every answer is rendered from the same stored task (its record and its event
log). A background response is a task. See docs/protocol.md, "OpenAI compatibility".
"""

PREFIX = "/v1"


def is_openai_path(path: str) -> bool:
    """Whether a request path belongs to the OpenAI routes (their errors use OpenAI's error object)."""
    return path == PREFIX or path.startswith(PREFIX + "/")
