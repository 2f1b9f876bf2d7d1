"""The Litestar application."""

import asyncio
import contextlib
import functools
import gc

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.di import Provide

from api.background.batchdriver import BatchDriver
from api.background.conversations import TurnSettler
from api.background.webhooks import Webhooks
from api.http.auth import authorize, check_exposure, check_routes
from api.http.ignoredextensions import IGNORED_EXTENSIONS_HEADER
from api.http.injection import provide_identity, provide_owner, provide_services
from api.http.openapi import document as openapi
from api.http.openapi import openaibodies as openai_bodies
from api.http.problems import HANDLERS, problems_only
from api.http.routes import openai_files
from api.http.routes.health import healthz, prometheus_metrics, readyz, status
from api.http.routes.models import ModelsController
from api.http.routes.openai_batches import OpenAIBatchesController
from api.http.routes.openai_chat import OpenAIChatController, OpenAIModelsController
from api.http.routes.openai_compact import OpenAICompactController
from api.http.routes.openai_conversations import OpenAIConversationsController
from api.http.routes.openai_responses import OpenAIResponsesController
from api.http.routes.openai_responses_socket import responses_socket
from api.http.routes.playground import playground
from api.http.routes.responses import ResponsesController
from api.http.routes.tasks import TasksController
from api.http.routes.webhooks import WebhooksController
from api.http.strictbodies import StructSchemaFromMsgspec, strict_body
from api.http.tracing import TracingMiddleware
from api.http.version import VersionMiddleware, add_version_header
from api.process import Services
from api.submission.idempotency import HEADER as IDEMPOTENCY_HEADER
from api.submission.idempotency import REPLAYED_HEADER
from lmsp_core import tracing
from lmsp_core.settings import Settings, load_settings
from lmsp_core.store.objects import webhooks

# what the official OpenAI SDKs send with every request, so that they work from a browser page too
OPENAI_SDK_HEADERS = ["X-Stainless-Lang", "X-Stainless-Package-Version", "X-Stainless-OS", "X-Stainless-Arch",
                      "X-Stainless-Runtime", "X-Stainless-Runtime-Version", "X-Stainless-Retry-Count",
                      "X-Stainless-Timeout", "X-Stainless-Read-Timeout", "X-Stainless-Async", "OpenAI-Organization",
                      "OpenAI-Project"]


def cors_config(settings: Settings) -> CORSConfig | None:
    """CORS is off unless ``LMSP_CORS_ORIGINS`` names origins. Credentials (cookies) are never
    allowed, with ``*`` or otherwise: clients authenticate with an Authorization header instead."""
    origins = settings.cors_origin_list
    if not origins:
        return None
    return CORSConfig(
        allow_origins=origins, allow_methods=["GET", "POST", "DELETE"], allow_credentials=False,
        allow_headers=["Authorization", "Content-Type", IDEMPOTENCY_HEADER, "LMSP-Version", "Last-Event-ID",
                       *OPENAI_SDK_HEADERS],
        expose_headers=["LMSP-Version", "Location", "Retry-After", "WWW-Authenticate", REPLAYED_HEADER,
                        IGNORED_EXTENSIONS_HEADER],
    )


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or load_settings()
    check_exposure(settings)

    async def start(app: Litestar) -> None:
        tracing.setup("lmsp-api")  # off unless OTEL_EXPORTER_OTLP_*ENDPOINT is set
        app.state.services = Services.create(settings)
        app.state.services.limits.start()
        app.state.webhooks = Webhooks(app.state.services)
        app.state.webhooks.start()
        app.state.settler = TurnSettler(app.state.services)
        app.state.settler.start()
        driver = BatchDriver(app.state.services, functools.partial(webhooks.emit, app.state.services.redis))
        app.state.batches = asyncio.create_task(driver.run(), name="batch-driver")
        # everything loaded so far (modules, routes, schemas) lives as long as the process: take it
        # out of the collector's full passes, which otherwise stall every open stream at once
        gc.freeze()

    async def stop(app: Litestar) -> None:
        app.state.batches.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app.state.batches
        await app.state.webhooks.close()
        await app.state.settler.close()
        await app.state.services.close()
        await asyncio.to_thread(tracing.shutdown)  # sends the spans still buffered

    app = Litestar(
        route_handlers=[ResponsesController, TasksController, ModelsController, OpenAIResponsesController,
                        OpenAICompactController, responses_socket, OpenAIChatController, OpenAIModelsController,
                        healthz, readyz, prometheus_metrics, status, playground, openai_files.controller(settings),
                        OpenAIBatchesController, WebhooksController, OpenAIConversationsController],
        dependencies={
            "services": Provide(provide_services, sync_to_thread=False),
            "owner": Provide(provide_owner, sync_to_thread=False),
            "identity": Provide(provide_identity, sync_to_thread=False),
        },
        guards=[authorize],
        exception_handlers=HANDLERS,
        before_request=strict_body,
        after_request=problems_only,
        middleware=[TracingMiddleware(), VersionMiddleware()],
        before_send=[add_version_header],
        on_startup=[start],
        on_shutdown=[stop],
        state=State(),
        request_max_body_size=settings.max_body_bytes,
        cors_config=cors_config(settings),
        openapi_config=openapi.config(),
        plugins=[StructSchemaFromMsgspec({**openapi.BODIES, **openai_bodies.BODIES})],
        logging_config=None,
    )
    check_routes(app)
    return app
