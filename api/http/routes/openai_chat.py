"""OpenAI's Chat Completions and Models: ``POST /v1/chat/completions`` (a direct response in chat
form, streamed as ``chat.completion.chunk`` objects when asked) and ``GET /v1/models``."""

from typing import Annotated, Any

from litestar import Controller, Request, Response, get, post
from litestar.params import Body

from api.follow import streams
from api.follow.framing import ChatFrames
from api.http.openapi import openai as docs
from api.openai import PREFIX
from api.openai import requests as rq
from api.openai.chat import completion
from api.openai.chatobjects import ChatCompletion
from api.openai.chattranslation import CHAT_PARAMS, chat_request
from api.openai.errors import errors_only, with_param
from api.openai.objects import Model, ModelList
from api.process import Services
from api.submission import idempotency
from api.submission.idempotency import REPLAYED, IdempotencyKey
from lmsp_core import wire
from lmsp_core.store import registry
from lmsp_core.store.tenants import credentials
from lmsp_core.wire.errors import GenerationFailed, LmspError

ENDPOINT = "openai.chat"  # Idempotency-Key fingerprints: never shared with another route
_EXPIRED = "The events of this completion have expired; repeat it without stream to get it."

_STREAMED = docs.with_event_stream("`chat.completion.chunk` objects as `data:` lines, then `data: [DONE]`",
                                   docs.CHAT_EVENTS, docs.CHAT_STREAM)


class OpenAIChatController(Controller):
    path = f"{PREFIX}/chat/completions"
    tags = ["openai"]

    @post(status_code=200, summary="Create a chat completion (OpenAI)", opt={"scope": credentials.RESPONSES_WRITE},
          operation_class=_STREAMED, after_request=errors_only,
          description="OpenAI's `chat.completions.create`, as a direct response: the `chat.completion`, or with "
                      "`stream: true` its chunks (`text/event-stream`; `stream_options.include_usage` adds a last "
                      "chunk with the usage). A client that goes away stops the generation (unless the request "
                      "has an `Idempotency-Key`). Unsupported parameters are refused with `400` naming them.",
          responses={200: docs.ok(ChatCompletion, "The chat completion", docs.CHAT),
                     **docs.errors(*docs.GENERATION_ERRORS)})
    async def create_chat_completion(
        self, request: Request[Any, Any, Any], data: Annotated[rq.ChatRequest, Body(examples=docs.CHAT_REQUESTS)],
        services: Services, owner: str, idempotency_key: IdempotencyKey = None,
    ) -> Response[Any]:
        key = idempotency.parse_key(idempotency_key)
        try:
            lmsp = chat_request(data, services.catalog.get(data.model))
            record, repeated, slot = await streams.open(services, lmsp, kind="direct", owner=owner,
                                                        stream=bool(data.stream), expired=_EXPIRED,
                                                        idempotency_key=key, endpoint=ENDPOINT)
        except LmspError as exc:
            raise with_param(exc, CHAT_PARAMS) from None
        headers = REPLAYED if repeated else {}
        if slot is not None:
            usage = bool(data.stream_options and data.stream_options.include_usage)
            return streams.stream(services, slot, record, ChatFrames(record, usage), cancel=key is None,
                                  headers=headers)
        if not await streams.final_or_disconnect(services, record, request.receive, cancel=key is None):
            return Response(content=b"", status_code=499)
        final = await services.store.get(record.id)
        if final is None:
            raise GenerationFailed("The completion was lost before it could be returned.")
        return Response(content=wire.encoder.encode(completion(final)), media_type="application/json",
                        headers=headers)


class OpenAIModelsController(Controller):
    path = f"{PREFIX}/models"
    tags = ["openai"]
    opt = {"scope": credentials.MODELS_READ}

    @get(summary="List models (OpenAI)", after_request=errors_only,
         description="OpenAI's `models.list`: the models this deployment serves, those a live worker runs or the "
                     "service was configured with (`GET /lmsp/v1/models` tells which have workers, and their limits "
                     "and capabilities). `created` is 0: models have no creation time here.",
         responses={200: docs.ok(ModelList, "The models", docs.MODELS), **docs.errors(*docs.COMMON_ERRORS)})
    async def list_models(self, services: Services) -> Response[Any]:
        served = services.catalog.listed(registry.models_run(await registry.live_workers(services.redis)))
        models = ModelList(data=[Model(id=spec.id) for spec in served])
        return Response(content=wire.encoder.encode(models), media_type="application/json")

    @get("/{model:path}", summary="Retrieve a model (OpenAI)", description="OpenAI's `models.retrieve` (an id may "
         "have a slash: `ORG/NAME`).",
         after_request=errors_only,
         responses={200: docs.ok(Model, "The model", docs.MODELS.data[0]),
                    **docs.errors(*docs.COMMON_ERRORS, "model_not_found")})
    async def retrieve_model(self, model: str, services: Services) -> Response[Any]:
        try:
            spec = services.catalog.get(model.removeprefix("/"))
        except LmspError as exc:
            raise with_param(exc, {"model_not_found": "model"}) from None
        return Response(content=wire.encoder.encode(Model(id=spec.id)), media_type="application/json")
