"""The metrics of issue 53 on a running service, and the Grafana dashboard and Prometheus alert
rules over them (observability/): every query names series that ``/metrics`` exposes."""

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT, Api, RedisServer, Worker, body, sse_events

OBSERVABILITY = ROOT / "observability"
MODEL = {"model": "tiny-random"}
# what the issue asks the dashboard to show, by the families' names
REQUIRED = {"lmsp_e2e_request_latency_seconds", "lmsp_request_prefill_time_seconds",
            "lmsp_time_per_output_token_seconds", "lmsp_prompt_tokens", "lmsp_generated_tokens",
            "lmsp_requests_running", "lmsp_requests_waiting", "lmsp_kv_slots_usage", "lmsp_step_batch_size",
            "lmsp_task_resumes", "lmsp_task_reclaims", "lmsp_time_to_first_token_seconds", "lmsp_queue_time_seconds"}
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


class Exposed:
    """One scrape: its samples, and the series names its families may have (a counter's and a
    histogram's names too, where no sample exists yet: a family with no series is listed all the same)."""

    def __init__(self, text: str) -> None:
        families = list(text_string_to_metric_families(text))
        self.samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                        for family in families for sample in family.samples}
        self.families = {family.name: family.type for family in families}
        self.names = {family.name + suffix for family in families for suffix in _SUFFIXES.get(family.type, ("",))}

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(client: httpx.AsyncClient) -> Exposed:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return Exposed(response.text)


async def run_task(client: httpx.AsyncClient, tokens: int) -> None:
    task = (await client.post("/lmsp/v1/tasks", json=body(max_output_tokens=tokens))).json()
    async for _ in sse_events(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events"):
        pass


async def after_a_task(client: httpx.AsyncClient) -> tuple[Exposed, Exposed]:
    """The metrics before and after a task of 20 tokens, once its worker's heartbeat has added them."""
    before = await scrape(client)
    await run_task(client, 20)
    deadline = time.monotonic() + 60
    while True:
        after = await scrape(client)
        if after.value("lmsp_e2e_request_latency_seconds_count", **MODEL) > before.value(
                "lmsp_e2e_request_latency_seconds_count", **MODEL):
            return before, after
        assert time.monotonic() < deadline, "the worker's figures never arrived"
        await asyncio.sleep(0.2)


async def test_a_task_adds_to_the_latency_token_and_engine_series(client: httpx.AsyncClient) -> None:
    before, after = await after_a_task(client)

    def grew(name: str, by: float = 1) -> bool:
        return after.value(name, **MODEL) >= before.value(name, **MODEL) + by

    for histogram in ("lmsp_e2e_request_latency_seconds", "lmsp_request_prefill_time_seconds",
                      "lmsp_request_decode_time_seconds", "lmsp_time_per_output_token_seconds"):
        assert grew(f"{histogram}_count"), histogram
        assert after.value(f"{histogram}_bucket", le="+Inf", **MODEL) == after.value(f"{histogram}_count", **MODEL)
    assert grew("lmsp_prompt_tokens_total", 2)  # "Hello there" in the chat template: more than two tokens
    assert grew("lmsp_step_batch_size_count", 20)  # a step a token at least
    assert after.value("lmsp_step_batch_size_sum", **MODEL) >= after.value("lmsp_step_batch_size_count", **MODEL)
    # the end-to-end latency covers the decode time of the same task
    e2e = after.value("lmsp_e2e_request_latency_seconds_sum", **MODEL) - before.value(
        "lmsp_e2e_request_latency_seconds_sum", **MODEL)
    decode = after.value("lmsp_request_decode_time_seconds_sum", **MODEL) - before.value(
        "lmsp_request_decode_time_seconds_sum", **MODEL)
    assert e2e >= decode > 0
    assert after.value("lmsp_kv_slots", **MODEL) >= 1 and after.value("lmsp_redis_up") == 1
    assert 0 <= after.value("lmsp_kv_slots_usage", **MODEL) <= 1
    assert ("lmsp_requests_running", (("model", "tiny-random"),)) in after.samples
    assert after.value("lmsp_requests_waiting", model="tiny-unserved") == after.value("lmsp_queue_depth",
                                                                                       model="tiny-unserved")
    assert {"lmsp_task_resumes", "lmsp_task_reclaims"} <= set(after.families)  # counted in tests/e2e/test_tracing.py


async def test_kv_slots_in_use_show_while_a_task_runs(client: httpx.AsyncClient, variant_worker: Worker) -> None:
    """A long task (tiny-serial: one slot) holds its slot over several heartbeats."""
    serial = {"model": "tiny-serial"}
    task = (await client.post("/lmsp/v1/tasks", json=body(max_output_tokens=30000, **serial))).json()
    deadline = time.monotonic() + 60
    try:
        while (now := await scrape(client)).value("lmsp_kv_slots_used", **serial) < 1:
            assert time.monotonic() < deadline, "no slot was ever in use"
            await asyncio.sleep(0.1)
        assert now.value("lmsp_requests_running", **serial) == 1 and now.value("lmsp_kv_slots", **serial) == 1
        assert now.value("lmsp_kv_slots_usage", **serial) == 1
    finally:
        await client.post(f"/lmsp/v1/tasks/{task['id']}/cancel")


def metric_names(expression: str) -> set[str]:
    """The series an expression selects (ours, and Prometheus's own ``up``)."""
    return set(re.findall(r"\b(lmsp_[a-z0-9_]+|up)\b(?=\s*[{\[),\s])", expression + " "))


def dashboard_queries() -> list[str]:
    dashboard = json.loads((OBSERVABILITY / "grafana/dashboards/lmsp.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variables = [variable["query"]["query"] for variable in dashboard["templating"]["list"]]
    return queries + variables


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((OBSERVABILITY / "prometheus/alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


async def test_every_dashboard_and_alert_query_names_an_exposed_metric(client: httpx.AsyncClient) -> None:
    _, exposed = await after_a_task(client)
    queries = dashboard_queries()
    assert len(queries) >= 20
    named: set[str] = set()
    for query in queries:
        names = metric_names(query)
        assert names, f"no metric in {query!r}"
        assert names <= exposed.names, f"{query!r} names {names - exposed.names}, which /metrics does not expose"
        named |= names
    assert {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in named} >= REQUIRED
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} >= {"LmspNoWorkerForModel", "LmspQueueTimeGrowing", "LmspRedisAway"}
    for rule in rules:
        names = metric_names(rule["expr"]) - {"up"}  # Prometheus's own series of a scrape
        assert names <= exposed.names, f"{rule['alert']} names {names - exposed.names}"
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


@pytest.mark.timeout(120)
async def test_metrics_say_so_when_redis_is_away(models_file: str) -> None:
    """``lmsp_redis_up`` (the "Redis away" alert): 0, with a 200, while the API cannot reach Redis."""
    redis = RedisServer()
    redis.start()
    api = Api(redis.url, models_file=models_file).start()
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
            assert (await scrape(http)).value("lmsp_redis_up") == 1
            redis.stop()
            away = await scrape(http)
            assert away.value("lmsp_redis_up") == 0 and "lmsp_queue_depth" not in away.families
            assert "lmsp_open_streams" in away.families  # this process's own series go on
    finally:
        api.stop()
        redis.cleanup()
