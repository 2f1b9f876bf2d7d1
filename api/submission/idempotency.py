"""The ``Idempotency-Key`` header on the routes that create tasks (``POST /responses``, ``POST /tasks``
and OpenAI's), scoped per principal: its form, checked here; its reservations are kept by
``lmsp_core.store.tasks.idempotency``, which ``api.submission.submit`` consults.
"""

from typing import Annotated

from litestar.params import HeaderParameter

from lmsp_core.store.tasks.idempotency import HEADER
from lmsp_core.wire.errors import InvalidRequest

MAX_KEY_LENGTH = 255
REPLAYED_HEADER = "Idempotent-Replayed"
REPLAYED = {REPLAYED_HEADER: "true"}  # on the answers to repeats

# documented as parse_key checks it, so that every key the schema allows is accepted
KEY_SCHEMA = {"type": "string", "oneOf": None, "minLength": 1, "maxLength": MAX_KEY_LENGTH, "pattern": "^[!-~]+$"}
IdempotencyKey = Annotated[str | None, HeaderParameter(
    name=HEADER, description=f"1-{MAX_KEY_LENGTH} visible ASCII characters; a repeat with the same key and body "
                             "answers from the first request's generation", schema_extra=KEY_SCHEMA)]

__all__ = ["HEADER", "REPLAYED", "REPLAYED_HEADER", "IdempotencyKey", "parse_key"]


def parse_key(raw: str | None) -> str | None:
    if raw is None:
        return None
    if not 1 <= len(raw) <= MAX_KEY_LENGTH or not all(" " < c <= "~" for c in raw):
        raise InvalidRequest(f"{HEADER} must be 1-{MAX_KEY_LENGTH} visible ASCII characters.",
                             code="invalid_idempotency_key")
    return raw
