"""Python client of the LMSP service, sync (``Client``) and asyncio (``AsyncClient``).

    from lmsp.client import Client

    with Client() as client:                      # http://127.0.0.1:8000, token from $LMSP_TOKEN
        print(client.responses.create(model="smollm2:135m-instruct", input="Hi!").output)
        task = client.tasks.create(model="smollm2:135m-instruct", input="Write a poem.")
        for event in client.tasks.events(task.id):  # resumes by itself after a dropped connection
            print(event.delta, end="")
        batch, output, errors = client.batches.run("requests.jsonl", endpoint="/v1/chat/completions")

Responses, tasks and models are the wire Structs of ``lmsp_core.wire``; events are ``Event``; files and
batches are the Structs of ``lmsp.client.batches`` (OpenAI's objects); problem documents and OpenAI's
error objects become ``errors.APIStatusError`` subclasses.
"""

from lmsp.client.aio import AsyncClient
from lmsp.client.batches import Batch, BatchResult, FileObject, RequestCounts
from lmsp.client.common import DEFAULT_URL, Event, Reconnects
from lmsp.client.errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    EventHistoryExpired,
    LmspClientError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    StreamError,
)
from lmsp.client.sync import Client

__all__ = [
    "DEFAULT_URL", "APIConnectionError", "APIStatusError", "AsyncClient", "AuthenticationError", "BadRequestError",
    "Batch", "BatchResult", "Client", "ConflictError", "Event", "EventHistoryExpired", "FileObject", "LmspClientError",
    "NotFoundError", "PermissionDeniedError", "RateLimitError", "Reconnects", "RequestCounts", "ServerError",
    "ServiceUnavailableError", "StreamError",
]
