"""The worker process: load models, publish their cards, take jobs until told to stop.

SIGTERM or SIGINT: stop taking jobs, let running tasks finish for ``shutdown_grace`` seconds,
then hand the rest back to the queue (their next worker resumes them from the stored events).
"""

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from arq.connections import ArqRedis
from arq.worker import func
from redis.exceptions import RedisError

from lmsp_core import logs, tracing
from lmsp_core.requests.catalog import Catalog, ModelSpec
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import Settings
from lmsp_core.store import connections, keys, registry
from lmsp_core.store.cluster import ClusterClient
from lmsp_core.store.tasks import queue
from lmsp_core.store.tasks.queue import GENERATE
from workers import notices
from workers.engine.core import Engine
from workers.model import loader
from workers.model.gguf import ModelFileError
from workers.output.grammar import tokenizer_for
from workers.queueworker import WakeableWorker
from workers.reaper import Reaper
from workers.service import WorkerService
from workers.taskrun import ModelRuntime

logger = logging.getLogger(__name__)

CONNECT_ATTEMPTS = 6  # as arq's create_pool did: the first try and five more, a second apart
CONNECT_RETRY_DELAY = 1.0


EngineFactory = Callable[[loader.LoadedModel], Engine]


def run(settings: Settings, model_ids: list[str], make_engine: EngineFactory = Engine) -> None:
    """``make_engine``: builds each model's engine (a benchmark's simulated model: ``bench.simulated``)."""
    logs.configure(settings.log_level, settings.log_json)
    loader.limit_threads(settings.torch_threads, settings.attention_helper)
    try:
        asyncio.run(serve(settings, model_ids, make_engine))
    except ModelFileError as exc:  # no restart serves it: one line and status 2, as a bad argument
        print(f"lmsp worker: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


async def connect(settings: Settings) -> ArqRedis:
    """The Redis client of every part of the worker (arq's polling, the writer, the reaper, ...). A
    worker needs Redis to start: it gives up after a few attempts, and its supervisor restarts it."""
    redis = connections.connect(settings)
    left = CONNECT_ATTEMPTS
    while True:
        try:
            await redis.ping()
            if connections.is_cluster(redis):
                await cast(ClusterClient, redis).check_version()
            return redis
        except RuntimeError as exc:  # a Redis that cannot serve us: said in one line, no retry
            await connections.close(redis)
            raise SystemExit(f"lmsp worker: {exc}") from None
        except (RedisError, OSError) as exc:
            left -= 1
            if not left:
                await connections.close(redis)
                raise
            logger.warning("Redis unavailable (%s); %d more attempts", type(exc).__name__, left)
            await asyncio.sleep(CONNECT_RETRY_DELAY)


async def serve(settings: Settings, model_ids: list[str], make_engine: EngineFactory = Engine) -> None:
    tracing.setup("lmsp-worker")  # off unless OTEL_EXPORTER_OTLP_*ENDPOINT is set
    catalog = Catalog.from_settings(settings)
    specs = [catalog.get(model_id) for model_id in model_ids]
    compiled_cache(Path(settings.model_cache))
    redis = await connect(settings)
    info = registry.new_worker(model_ids, str(loader.pick_device(specs[0])))
    announcing = asyncio.create_task(_announce(redis, info, settings))  # warming, until the models are ready
    engines: list[asyncio.Task[None]] = []
    try:
        runtimes = await _start_models(specs, settings, engines, make_engine)
    finally:
        announcing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await announcing
    service = WorkerService(settings, redis, runtimes, info)
    for runtime in runtimes.values():
        await registry.publish_card(redis, runtime.renderer.card)
    workers = [
        WakeableWorker(
            functions=[func(service.generate, name=GENERATE)],
            queue_name=keys.queue(model_id),
            redis_pool=queue.arq_client(redis, model_id),  # on a cluster: the queue's shard
            max_jobs=runtime.spec.max_batch_size,
            job_timeout=settings.job_timeout + 60,  # our own limit (job_timeout) fires first
            keep_result=0,
            max_tries=1_000_000,  # retries are counted by task attempts, not by arq
            wake=service.wakes[model_id],
            pick=functools.partial(service.pick, model_id) if settings.fair_share else None,
            after_job_end=functools.partial(service.job_ended, model_id),
        )
        for model_id, runtime in runtimes.items()
    ]
    reaper = Reaper(redis, service.store, settings, runtimes, held_here=service.runs.keys)
    duties = [service.writer.run(), service.heartbeat(), service.renew_leases(), reaper.run(),
              notices.listen(redis, service.notices(), service.poll_all, sharded=service.wake_channels())]
    background = engines + [asyncio.create_task(duty) for duty in duties]
    polling = [asyncio.create_task(worker.main()) for worker in workers]
    await registry.heartbeat(redis, service.info, settings.worker_ttl)
    logger.info("worker %s taking jobs for %s", service.info.id, ", ".join(runtimes))
    await _until_signal()
    await _shut_down(settings, service, workers, polling)
    for task in background:
        task.cancel()
    with contextlib.suppress(Exception):
        await service.metrics.flush(redis)
    with contextlib.suppress(Exception):
        await registry.deregister(redis, service.info.id)
    for runtime in runtimes.values():
        runtime.engine.close()
    await connections.close(redis)
    await asyncio.to_thread(tracing.shutdown)  # sends the spans still buffered


def compiled_cache(model_cache: Path) -> None:
    """Compiled decoding steps are kept beside the converted models, so a restart does not compile
    again. torch's inductor cache; torch sets TORCHINDUCTOR_CACHE_DIR itself when imported, so the
    variable is replaced, not defaulted."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(model_cache / "compiled")


async def _start_models(specs: list[ModelSpec], settings: Settings, engines: list[asyncio.Task[None]],
                        make_engine: EngineFactory) -> dict[str, ModelRuntime]:
    """Load each model and warm up its engine (``engines`` gets their running tasks)."""
    runtimes: dict[str, ModelRuntime] = {}
    for spec in specs:
        loaded = await asyncio.to_thread(loader.load, spec, Path(settings.model_cache))
        # packing the weights and building the CPU kernels take seconds: off the event loop (heartbeats)
        engine = await asyncio.to_thread(make_engine, loaded)
        engines.append(asyncio.create_task(engine.run()))
        started = time.monotonic()
        await engine.ready()
        logger.info("model %s ready on %s (%s%s, warmed up in %.1f s)", spec.id, loaded.device,
                    str(loaded.dtype).removeprefix("torch."), ", compiled" if engine.compile else "",
                    time.monotonic() - started)
        runtimes[spec.id] = ModelRuntime(spec, engine, PromptRenderer(loaded.card),
                                         await asyncio.to_thread(tokenizer_for, loaded.card))
    return runtimes


async def _announce(redis: ArqRedis, info: registry.WorkerInfo, settings: Settings) -> None:
    while True:
        with contextlib.suppress(RedisError, OSError):
            await registry.heartbeat(redis, info, settings.worker_ttl)
        await asyncio.sleep(settings.worker_heartbeat)


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _shut_down(settings: Settings, service: WorkerService, workers: list[WakeableWorker],
                     polling: list[asyncio.Task[None]]) -> None:
    logger.info("stopping: %d running tasks", len(service.runs))
    for worker in workers:
        worker.stop_taking_jobs()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(service.idle(), settings.shutdown_grace)
    jobs = [task for worker in workers for task in worker.running_jobs()]
    for worker in workers:
        worker.cancel_jobs()  # each hands its task back
    await asyncio.gather(*jobs, return_exceptions=True)
    for task in polling:
        task.cancel()
    await asyncio.gather(*polling, return_exceptions=True)
