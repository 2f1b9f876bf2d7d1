"""Liveness and readiness probes."""

from litestar import Response, get
from redis.exceptions import RedisError

from api.services import Services
from lmsp_core import registry
from lmsp_core.errors import ServiceUnavailable


@get("/healthz", summary="Liveness", tags=["health"], opt={"public": True})
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: Redis reachable and at least one live worker (else 503 not_ready)", tags=["health"],
     opt={"public": True})
async def readyz(services: Services) -> Response[dict[str, object]]:
    try:
        await services.redis.ping()
        workers = await registry.live_workers(services.redis)
    except (RedisError, OSError):
        raise ServiceUnavailable("Not ready: Redis is unreachable.", code="not_ready", retry_after=2) from None
    if not workers:
        raise ServiceUnavailable("Not ready: no worker is alive.", code="not_ready", retry_after=2)
    return Response({"status": "ok", "redis": True, "workers": len(workers)})
