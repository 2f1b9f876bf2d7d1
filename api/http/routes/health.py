"""Probes, metrics and the service status: liveness, readiness, Prometheus, the playground's view."""

from litestar import MediaType, Response, get
from redis.exceptions import RedisError

from api.http.openapi import document as doc
from api.metrics import ModelState, PrincipalState, ServiceState, WorkerState, service_state
from api.process import Services
from lmsp_core.store import registry
from lmsp_core.wire.errors import ServiceUnavailable

# the Prometheus text format 0.0.4 (Litestar adds the charset)
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4"
_READY = doc.LiteralExample(summary="Ready", value={
    "status": "ok", "redis": True, "workers": 1, "warming": 0, "models": {doc.MODEL: 1, "tiny-random": 0}})
_STATUS = ServiceState(
    models=[ModelState(id=doc.MODEL, status="available", workers=1, queued=2, running=4)],
    workers=[WorkerState(id="gpu-host-4242-a1b2c3", host="gpu-host", device="cuda:0", models=[doc.MODEL],
                         state="ready", running=4, started_at=1794200000)],
    principals=[PrincipalState(model=doc.MODEL, principal="team-a", queued=2, running=3, generated_tokens=91544,
                               weight=2.0, max_running=None, max_queued=100),
                PrincipalState(model=doc.MODEL, principal="team-b", queued=0, running=1, generated_tokens=12210,
                               weight=1.0, max_running=None, max_queued=None)],
)
_METRICS = """# HELP lmsp_queue_depth Tasks waiting in a model's queue.
# TYPE lmsp_queue_depth gauge
lmsp_queue_depth{model="smollm2:135m-instruct"} 2.0
# HELP lmsp_generated_tokens_total Tokens generated (rate() of it is the service's tokens/s).
# TYPE lmsp_generated_tokens_total counter
lmsp_generated_tokens_total{model="smollm2:135m-instruct"} 18234.0
# HELP lmsp_principal_tasks A principal's tasks in a model's fair queue, by status (queued, running); the ~other \
series sums the principals beyond a model's first LMSP_METRICS_PRINCIPALS.
# TYPE lmsp_principal_tasks gauge
lmsp_principal_tasks{model="smollm2:135m-instruct",principal="team-a",status="queued"} 2.0
lmsp_principal_tasks{model="smollm2:135m-instruct",principal="team-a",status="running"} 3.0
"""


@get("/healthz", summary="Liveness", tags=["health"], description="`200` while the process serves HTTP.",
     opt={"public": True},
     responses={200: doc.ok(dict[str, str], "Alive", doc.LiteralExample(summary="Alive", value={"status": "ok"}))})
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: Redis reachable and at least one live worker", tags=["health"],
     opt={"public": True},
     description="`200` when Redis answers and at least one worker is ready, else a `503 not_ready` problem "
                 "document (a worker that is loading and warming up its models, compiling, is not ready yet). "
                 "`models` counts the ready workers of each model of the catalog, `warming` the others.",
     responses={200: doc.ok(dict[str, object], "Ready", _READY), **doc.problems("not_ready")})
async def readyz(services: Services) -> Response[dict[str, object]]:
    try:
        await services.redis.ping()
        workers = await registry.live_workers(services.redis)
    except (RedisError, OSError):
        raise ServiceUnavailable("Not ready: Redis is unreachable.", code="not_ready", retry_after=2) from None
    ready = [info for info in workers if info.state == "ready"]
    if not ready:
        detail = "workers are still warming up" if workers else "no worker is alive"
        raise ServiceUnavailable(f"Not ready: {detail}.", code="not_ready", retry_after=2)
    counts = registry.ready_per_model(workers)
    models = {spec.id: counts[spec.id] for spec in services.catalog}
    return Response({"status": "ok", "redis": True, "workers": len(ready), "warming": len(workers) - len(ready),
                     "models": models})


@get("/metrics", summary="Prometheus metrics", tags=["health"], media_type=METRICS_MEDIA_TYPE,
     opt={"scope": "models:read"},
     description="Prometheus text format: queue depth, tasks by status, time in queue, time to first token, "
                 "inter-token latency, end-to-end latency, prefill and decode time and time per output token "
                 "histograms, prompt and generated tokens (`rate()` gives tokens/s), running and waiting requests, "
                 "KV slots in use, batch size per engine step, resumes and re-claims, workers alive, whether "
                 "Redis answered (`lmsp_redis_up`; 0: only this process's series follow), "
                 "each principal's queued and running tasks and generated tokens (the `LMSP_METRICS_PRINCIPALS` "
                 "busiest of a model, the rest summed as `principal=\"~other\"`) (service-wide, from Redis), "
                 "and the SSE streams open in this process.",
     responses={200: doc.ok(str, "Metrics", doc.LiteralExample(summary="Excerpt", value=_METRICS),
                            media_type=METRICS_MEDIA_TYPE), **doc.problems("service_unavailable", *doc.GUARDED)})
async def prometheus_metrics(services: Services) -> Response[bytes]:
    body = await services.metrics.render(services.redis, services.catalog, services.settings)
    return Response(body, media_type=METRICS_MEDIA_TYPE)


@get("/status", summary="Queues and workers", tags=["health"], media_type=MediaType.JSON,
     opt={"scope": "models:read"},
     description="Each model's live workers, waiting and running tasks, and the live workers (the playground "
                 "shows this); per model and principal, its queued and running tasks, generated tokens, weight and "
                 "quotas (the `LMSP_METRICS_PRINCIPALS` busiest principals of a model, the rest summed as "
                 "`~other`).",
     responses={200: doc.ok(ServiceState, "The service's state", doc.example("Status", _STATUS)),
                **doc.problems("service_unavailable", *doc.GUARDED)})
async def status(services: Services) -> ServiceState:
    return await service_state(services.redis, services.catalog, services.settings)
