"""Running the API with uvicorn."""

import uvicorn

from api.http.app import create_app
from lmsp_core import logs
from lmsp_core.settings import Settings


def run(settings: Settings) -> None:
    logs.configure(settings.log_level, settings.log_json)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=5)
