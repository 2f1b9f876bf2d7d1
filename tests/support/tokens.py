"""Bearer tokens for fresh principals, and the OpenAI routes with the scope each needs
(tests/e2e/test_auth.py checks the table, tests/e2e/test_openai_access.py their answers)."""

import uuid

import redis.asyncio as aioredis

from lmsp_core.store.tenants import credentials


class TokenFactory:
    """Creates tokens, each for a fresh principal unless one is given."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def __call__(self, scopes: list[str] | None = None, principal: str | None = None) -> tuple[str, str]:
        """A new token and its principal."""
        principal = principal or f"p-{uuid.uuid4().hex[:12]}"
        granted = list(credentials.GRANTABLE) if scopes is None else scopes
        token, _ = await credentials.create(self.redis, principal, granted)
        return token, principal


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


OPENAI_ROUTES: list[tuple[str, str, str | None]] = [
    ("POST", "/v1/responses", credentials.RESPONSES_WRITE),
    ("GET", "/v1/responses/{response_id}", credentials.RESPONSES_READ),
    ("POST", "/v1/responses/{response_id}/cancel", credentials.TASKS_WRITE),
    ("DELETE", "/v1/responses/{response_id}", credentials.RESPONSES_WRITE),
    ("GET", "/v1/responses/{response_id}/input_items", credentials.RESPONSES_READ),
    ("POST", "/v1/responses/input_tokens", credentials.RESPONSES_READ),
    ("POST", "/v1/responses/compact", credentials.RESPONSES_WRITE),
    ("POST", "/v1/chat/completions", credentials.RESPONSES_WRITE),
    ("GET", "/v1/models", credentials.MODELS_READ),
    ("GET", "/v1/models/{model}", credentials.MODELS_READ),
    ("POST", "/v1/files", credentials.TASKS_WRITE),
    ("GET", "/v1/files", credentials.TASKS_READ),
    ("GET", "/v1/files/{file_id}", credentials.TASKS_READ),
    ("GET", "/v1/files/{file_id}/content", credentials.TASKS_READ),
    ("DELETE", "/v1/files/{file_id}", credentials.TASKS_WRITE),
    ("POST", "/v1/batches", credentials.TASKS_WRITE),
    ("GET", "/v1/batches", credentials.TASKS_READ),
    ("GET", "/v1/batches/{batch_id}", credentials.TASKS_READ),
    ("POST", "/v1/batches/{batch_id}/cancel", credentials.TASKS_WRITE),
    ("POST", "/v1/conversations", credentials.RESPONSES_WRITE),
    ("GET", "/v1/conversations/{conversation_id}", credentials.RESPONSES_READ),
    ("POST", "/v1/conversations/{conversation_id}", credentials.RESPONSES_WRITE),
    ("DELETE", "/v1/conversations/{conversation_id}", credentials.RESPONSES_WRITE),
    ("GET", "/v1/conversations/{conversation_id}/items", credentials.RESPONSES_READ),
    ("POST", "/v1/conversations/{conversation_id}/items", credentials.RESPONSES_WRITE),
    ("GET", "/v1/conversations/{conversation_id}/items/{item_id}", credentials.RESPONSES_READ),
    ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}", credentials.RESPONSES_WRITE),
]
