"""The Litestar application."""

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide

from api import openapi
from api.deps import provide_owner, provide_services
from api.problems import HANDLERS
from api.routes.health import healthz, prometheus_metrics, readyz, status
from api.routes.models import ModelsController
from api.routes.playground import playground
from api.routes.responses import ResponsesController
from api.routes.tasks import TasksController
from api.services import Services
from api.version import VersionMiddleware, add_version_header
from lmsp_core.settings import Settings, load_settings

MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or load_settings()

    async def start(app: Litestar) -> None:
        app.state.services = Services.create(settings)

    async def stop(app: Litestar) -> None:
        await app.state.services.close()

    return Litestar(
        route_handlers=[ResponsesController, TasksController, ModelsController, healthz, readyz, prometheus_metrics,
                        status, playground],
        dependencies={
            "services": Provide(provide_services, sync_to_thread=False),
            "owner": Provide(provide_owner, sync_to_thread=False),
        },
        exception_handlers=HANDLERS,
        middleware=[VersionMiddleware()],
        before_send=[add_version_header],
        on_startup=[start],
        on_shutdown=[stop],
        state=State(),
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=openapi.config(),
        logging_config=None,
    )
