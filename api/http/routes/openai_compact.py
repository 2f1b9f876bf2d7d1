"""``POST /v1/responses/compact``: a conversation compacted by the model (``api.openai.compaction``).

The summary is a direct task like a non-streamed ``POST /v1/responses``: the call waits for its
final event, and a client that leaves first cancels it unless it sent an ``Idempotency-Key``.
"""

from typing import Annotated, Any

from litestar import Controller, Request, Response, post
from litestar.params import Body

from api.follow import streams
from api.http.openapi import compaction as examples
from api.http.openapi import openai as docs
from api.openai import PREFIX, compaction
from api.openai.errors import errors_only, with_param
from api.openai.translation import RESPONSES_PARAMS
from api.process import Services
from api.submission import idempotency
from api.submission.idempotency import REPLAYED, IdempotencyKey
from lmsp_core import wire
from lmsp_core.store.tenants import credentials
from lmsp_core.wire.errors import GenerationFailed, LmspError

ENDPOINT = "openai.responses.compact"  # Idempotency-Key fingerprints: never shared with another route
_EXPIRED = "The summary of this compaction has expired; repeat the request without its Idempotency-Key."


class OpenAICompactController(Controller):
    path = f"{PREFIX}/responses/compact"
    tags = ["openai"]

    @post(status_code=200, summary="Compact a conversation (OpenAI)", opt={"scope": credentials.RESPONSES_WRITE},
          after_request=errors_only,
          description="OpenAI's `responses.compact`: the conversation of `input` after the stored turns that "
                      "`previous_response_id` continues (either is required) is summarised by the model, as a task "
                      "a worker runs. The answer lists the conversation's user messages, then one `compaction` "
                      "item that holds the summary (as plain text: see docs/protocol.md, \"OpenAI "
                      "compatibility\"); it is the `input` of the next `POST /v1/responses`. Nothing is stored.",
          responses={200: docs.ok(compaction.Compacted, "The compacted conversation", examples.COMPACTED),
                     **docs.errors(*docs.GENERATION_ERRORS, "response_not_found")})
    async def compact_response(
        self, request: Request[Any, Any, Any],
        data: Annotated[compaction.CompactRequest, Body(examples=examples.REQUESTS)],
        services: Services, owner: str, idempotency_key: IdempotencyKey = None,
    ) -> Response[Any]:
        key = idempotency.parse_key(idempotency_key)
        try:
            spec = services.catalog.get(data.model)
            chain = await services.conversations.chain(data.previous_response_id, owner) \
                if data.previous_response_id is not None else []
            items = compaction.conversation(data, chain)
            record, repeated, _ = await streams.open(
                services, compaction.summarising_request(data, spec, items), kind="direct", owner=owner,
                stream=False, expired=_EXPIRED, idempotency_key=key, endpoint=ENDPOINT)
        except LmspError as exc:
            raise with_param(exc, RESPONSES_PARAMS) from None
        if not await streams.final_or_disconnect(services, record, request.receive, cancel=key is None):
            return Response(content=b"", status_code=499)
        final = await services.store.get(record.id)
        if final is None:
            raise GenerationFailed("The summary was lost before it could be returned.")
        return Response(content=wire.encoder.encode(compaction.compacted(final, items)),
                        media_type="application/json", headers=REPLAYED if repeated else {})
