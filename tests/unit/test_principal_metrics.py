"""The per-principal rows of ``/status`` and series of ``/metrics`` against a real Redis: at most
``LMSP_METRICS_PRINCIPALS`` named principals per model, the rest summed as ``~other``."""

from datetime import UTC, datetime

import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import OTHER, ApiMetrics, service_state
from lmsp_core.requests.catalog import Catalog, ModelSpec
from lmsp_core.settings import Settings
from lmsp_core.store import keys, metrics
from lmsp_core.store.tasks.fairqueue import FairQueue
from lmsp_core.store.tenants import principals
from lmsp_core.store.tenants.principals import PrincipalSettings

CAP = 3
T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def _wait(redis: aioredis.Redis, fair: FairQueue, model: str, principal: str, job: str) -> None:
    await redis.zadd(keys.queue(model), {job: T0.timestamp() * 1000})  # the arq queue
    assert await fair.admit(model, job, principal, T0, 10)


async def test_the_cap_names_the_busiest_and_sums_the_rest(redis: aioredis.Redis, settings: Settings,
                                                           model: str) -> None:
    fair = FairQueue(redis)
    name = {short: f"{model}-{short}" for short in ("busy", "runner", "a", "b", "c", "d", "e", "f")}  # CAP + 5
    await _wait(redis, fair, model, name["runner"], "r0")
    assert await fair.pick(model, 1, 10_000, {}) == ["r0"]
    for n in range(3):
        await _wait(redis, fair, model, name["busy"], f"busy{n}")
    # a, b and c tie on tokens: the name decides; the rest has no tasks and fewer tokens
    for short, tokens in {"runner": 5, "a": 50, "b": 50, "c": 50, "d": 10, "e": 3, "f": 1}.items():
        await metrics.add_now(redis, metrics.PRINCIPAL_TOKENS, (model, name[short]), tokens)
    await principals.store(redis, name["a"], PrincipalSettings(weight=2, max_queued=7))
    await principals.store(redis, name["b"], PrincipalSettings(weight=3))
    catalog = Catalog([ModelSpec(id=model, source="tiny-random", context_window=64, max_output_tokens=8,
                                 capabilities=["streaming"])])
    capped = settings.replace(metrics_principals=CAP)
    try:
        rows = [row for row in (await service_state(redis, catalog, capped)).principals if row.model == model]
        text = (await ApiMetrics().render(redis, catalog, capped)).decode()
    finally:
        await redis.hdel(keys.principals(), name["a"], name["b"])

    assert [(row.principal, row.queued, row.running, row.generated_tokens) for row in rows] == [
        (name["busy"], 3, 0, 0), (name["runner"], 0, 1, 5), (name["a"], 0, 0, 50), (OTHER, 0, 0, 50 + 50 + 10 + 3 + 1)]
    assert (rows[2].weight, rows[2].max_running, rows[2].max_queued) == (2.0, None, 7)
    assert (rows[3].weight, rows[3].max_running, rows[3].max_queued) == (3.0 + 4 * 1.0, None, None)

    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.labels.get("model") == model]
    tokens = {s.labels["principal"]: s.value for s in samples if s.name == "lmsp_principal_generated_tokens_total"}
    assert tokens == {name["busy"]: 0, name["runner"]: 5, name["a"]: 50, OTHER: 114}
    tasks = {(s.labels["principal"], s.labels["status"]): s.value for s in samples
             if s.name == "lmsp_principal_tasks"}
    assert len(tasks) == 2 * (CAP + 1)
    assert tasks[(name["busy"], "queued")] == 3 and tasks[(name["runner"], "running")] == 1
    assert tasks[(OTHER, "queued")] == tasks[(OTHER, "running")] == 0


async def test_without_a_rest_there_is_no_other_series(redis: aioredis.Redis, settings: Settings,
                                                       model: str) -> None:
    for n in range(CAP):
        await metrics.add_now(redis, metrics.PRINCIPAL_TOKENS, (model, f"{model}-{n}"), n + 1)
    # a model that is not in the catalog (any more) keeps its rows: the counter is stored
    state = await service_state(redis, Catalog([]), settings.replace(metrics_principals=CAP))
    assert [(row.principal, row.generated_tokens) for row in state.principals if row.model == model] == [
        (f"{model}-{n}", n + 1) for n in range(CAP)]
