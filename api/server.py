"""Running the API with uvicorn."""

import uvicorn

from api.http.app import create_app
from lmsp_core import logs
from lmsp_core.settings import Settings

# Idle keep-alive connections are closed after this long, well past the clients' own pool expiry
# (httpx, and so the openai SDK, drop theirs after 5 s, which is uvicorn's default here too): a
# client must never send on a connection the server is closing (docs/protocol.md, "Connections").
KEEP_ALIVE_S = 75


def run(settings: Settings) -> None:
    logs.configure(settings.log_level, settings.log_json)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_S)
