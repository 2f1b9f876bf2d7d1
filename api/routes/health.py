"""Liveness and readiness probes."""

from litestar import Response, get
from redis.exceptions import RedisError

from api.services import Services
from lmsp_core import registry


@get("/healthz", summary="Liveness", tags=["health"], opt={"public": True})
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: Redis reachable and at least one live worker", tags=["health"],
     opt={"public": True})
async def readyz(services: Services) -> Response[dict[str, object]]:
    try:
        await services.redis.ping()
        workers = await registry.live_workers(services.redis)
    except (RedisError, OSError):
        return Response({"status": "unavailable", "redis": False, "workers": 0}, status_code=503)
    ready = bool(workers)
    return Response({"status": "ok" if ready else "no_workers", "redis": True, "workers": len(workers)},
                    status_code=200 if ready else 503)
