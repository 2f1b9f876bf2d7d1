"""Traces across processes (issue 53): requests sent with a W3C ``traceparent`` give spans of that
trace from the API process and from the worker process, exported over OTLP/HTTP to a real receiver
(``tests.otlp``: protobuf decoded with OpenTelemetry's own package), also when the worker is killed
(SIGKILL) mid-generation and another finishes the task; batch lines and webhook deliveries carry the
trace of their batch and task.

One Redis, one API and two tiny-random workers, each exporting to the receiver under its own
``service.name``; short leases, so that a dead worker's task is reclaimed within seconds.
"""

import asyncio
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from tests.faults import Group, assert_exactly_once, text_of
from tests.otlp import OtlpReceiver, ReceivedSpan
from tests.support import Api, Receiver, RedisServer, Worker, body, chat_line, jsonl, logged, sse_events, until_final

MODEL = "tiny-random"
SETTINGS = {"lease_ttl": 1.5, "reaper_interval": 0.2, "max_attempts": 3, "shutdown_grace": 0,
            "webhook_allow_private": "true"}
API, WORKER = "lmsp-api", "lmsp-worker"
SERVER, CONSUMER = 2, 5  # OTLP's span kinds
GEN_AI = ("gen_ai.request.model", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.response.id",
          "gen_ai.response.finish_reasons")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as otlp:
        yield otlp


@pytest_asyncio.fixture(scope="module")
async def group(receiver: OtlpReceiver, models_file: str) -> AsyncIterator[Group]:
    redis = RedisServer()
    redis.start()
    api = Api(redis.url, models_file=models_file, **SETTINGS)
    api.env.update(receiver.env(API))
    workers = [Worker(redis.url, [MODEL], models_file=models_file, **SETTINGS) for _ in range(2)]
    for worker in workers:
        worker.env.update(receiver.env(WORKER))
    group = await Group.start(redis, [api], workers)
    try:
        yield group
    finally:
        await group.close()


def client_trace() -> tuple[str, str, str]:
    """A client's trace id, its span's id and the ``traceparent`` header that names them (sampled)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def runs(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    """The worker's spans of whole runs (``chat {model}``) that ended with a final status."""
    return [span for span in spans if span.service == WORKER and span.name == f"chat {MODEL}"
            and span.attributes.get("lmsp.task.outcome") in ("completed", "incomplete")]


def finished(spans: list[ReceivedSpan]) -> bool:
    names = {span.name for span in spans if span.service == WORKER}
    return bool(runs(spans)) and {"queue wait", "prefill", "decode", "end"} <= names and \
        any(span.service == API for span in spans)


def check_trace(spans: list[ReceivedSpan], parent: str, response_id: str, output_tokens: int,
                secret_texts: list[str]) -> ReceivedSpan:
    """The API's request span is the client's span's child, the worker's spans are in the request's
    subtree with the GenAI attributes, and no attribute holds the prompt or the output. Returns the
    API's span."""
    [request] = [span for span in spans if span.service == API and span.parent_id == parent]
    assert request.kind == SERVER and request.attributes["gen_ai.response.id"] == response_id
    run = runs(spans)[-1]
    assert run.kind == CONSUMER and run.parent_id == request.span_id
    assert all(name in run.attributes for name in GEN_AI), run.attributes
    assert run.attributes["gen_ai.request.model"] == MODEL and run.attributes["gen_ai.response.id"] == response_id
    assert run.attributes["gen_ai.usage.output_tokens"] == output_tokens
    assert run.attributes["gen_ai.usage.input_tokens"] > 0
    by_id = {span.span_id: span for span in spans}
    for name in ("prefill", "decode", "end"):
        [phase] = [span for span in spans if span.name == name and span.parent_id == run.span_id]
        assert by_id[phase.parent_id] is run and run.start_ns <= phase.start_ns <= phase.end_ns <= run.end_ns
    [queued] = [span for span in spans if span.name == "queue wait"]
    assert queued.parent_id == request.span_id and queued.end_ns <= run.start_ns + 1_000_000
    values = [str(value) for span in spans for value in span.attributes.values()]
    assert not [text for text in secret_texts if text and any(text in value for value in values)]
    return request


async def test_a_streamed_chat_request_is_one_trace_from_client_to_worker(group: Group,
                                                                          receiver: OtlpReceiver) -> None:
    trace_id, parent, header = client_trace()
    prompt = "Say something about the sea"
    sdk = openai.AsyncOpenAI(base_url=f"{group.apis[0].url}/v1", api_key="unused", max_retries=0)
    text, usage = "", None
    try:
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_headers={"traceparent": header})
        async with stream:
            async for chunk in stream:
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
                usage = chunk.usage or usage
    finally:
        await sdk.close()
    assert usage is not None and usage.completion_tokens == 12
    spans = await asyncio.to_thread(receiver.wait, finished, trace_id)
    run = runs(spans)[-1]
    check_trace(spans, parent, run.attributes["gen_ai.response.id"], 12, [prompt, text])
    assert run.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert {span.service for span in spans} == {API, WORKER}


async def test_a_background_task_is_one_trace_from_client_to_worker(group: Group, receiver: OtlpReceiver) -> None:
    trace_id, parent, header = client_trace()
    created = await group.http.post("/lmsp/v1/tasks", json=body(MODEL, "Hello there", max_output_tokens=9),
                                    headers={"traceparent": header})
    assert created.status_code == 202, created.text
    task = created.json()
    log = await group.log(task["id"])
    assert_exactly_once(log)
    spans = await asyncio.to_thread(receiver.wait, finished, trace_id)
    check_trace(spans, parent, task["response_id"], 9, ["Hello there", text_of(log)])


@pytest.mark.timeout(400)
async def test_the_trace_goes_on_after_its_worker_is_killed(group: Group, receiver: OtlpReceiver) -> None:
    """The worker running the task is SIGKILLed mid-generation; the one that reclaims it (the other,
    or the killed one restarted) resumes it, and its run joins the same trace."""
    trace_id, parent, header = client_trace()
    created = await group.http.post("/lmsp/v1/tasks", json=body(MODEL, "Tell me about the sea",
                                                                max_output_tokens=1000),
                                    headers={"traceparent": header})
    assert created.status_code == 202, created.text
    task = created.json()
    killed: list[str] = []

    def prefilled(spans: list[ReceivedSpan]) -> bool:
        return any(span.name == "prefill" for span in spans)

    async def kill() -> None:
        # once the run's first spans are exported (the batch's delay is short): what a SIGKILL leaves
        await asyncio.to_thread(receiver.wait, prefilled, trace_id, 30)
        holder = await group.holder(task["id"])
        killed.append(str(await group.field(task["id"], "worker")))
        holder.signal(signal.SIGKILL)
        holder.wait()
        holder.start()

    log = await group.follow_and_act(task["id"], 500, kill)
    assert_exactly_once(log)
    assert killed and await group.attempts(task["id"]) >= 2
    spans = await asyncio.to_thread(receiver.wait, finished, trace_id)
    request = check_trace(spans, parent, task["response_id"], 1000, ["Tell me about the sea", text_of(log)])
    run = runs(spans)[-1]
    assert run.attributes["lmsp.task.attempt"] >= 2 and run.attributes["lmsp.task.resumed"] is True
    assert run.attributes["lmsp.task.resumed_tokens"] > 0 and run.attributes["lmsp.worker.id"] != killed[0]
    # the killed run's prefill was exported before the kill: the trace holds both runs
    prefills = [span for span in spans if span.name == "prefill"]
    assert len(prefills) >= 2 and len({span.parent_id for span in prefills}) >= 2
    assert all(span.trace_id == trace_id for span in spans) and request.parent_id == parent
    for worker in group.workers:
        await worker.ready()


async def test_batch_lines_and_webhook_deliveries_carry_their_trace(group: Group, receiver: OtlpReceiver) -> None:
    trace_id, parent, header = client_trace()
    hooks = Receiver()
    sdk = openai.AsyncOpenAI(base_url=f"{group.apis[0].url}/v1", api_key="unused", max_retries=0,
                             default_headers={"traceparent": header})
    try:
        created = await group.http.post("/lmsp/v1/webhooks", json={"url": hooks.url, "events": ["batch.completed"]})
        assert created.status_code == 201, created.text
        lines = jsonl([chat_line("one", "Hi"), chat_line("two", "Ho")])
        source = await sdk.files.create(file=("requests.jsonl", lines), purpose="batch")
        batch = await sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        assert (await until_final(sdk, batch.id)).status == "completed"
        [delivered] = await hooks.wait(1)
    finally:
        await sdk.close()
        hooks.close()
    # the receiver is told which trace the event belongs to: the batch's, under the delivery's span
    assert delivered.headers["traceparent"].split("-")[1] == trace_id

    def complete(spans: list[ReceivedSpan]) -> bool:
        return len(runs(spans)) >= 2 and any(span.name == "webhook delivery" for span in spans)

    spans = await asyncio.to_thread(receiver.wait, complete, trace_id)
    [creating] = [span for span in spans if span.service == API and span.parent_id == parent
                  and span.attributes.get("http.route") == "/v1/batches"]
    lines = [span for span in spans if span.name == "batch line"]
    assert len(lines) == 2 and all(span.parent_id == creating.span_id for span in lines)
    line_ids = {span.span_id for span in lines}
    assert {run.parent_id for run in runs(spans)} <= line_ids
    [delivery] = [span for span in spans if span.name == "webhook delivery"]
    assert delivery.parent_id == creating.span_id and delivery.attributes["http.response.status_code"] == 200
    assert delivered.headers["traceparent"].split("-")[2] == delivery.span_id


async def test_an_invalid_traceparent_starts_a_trace_of_its_own(group: Group, receiver: OtlpReceiver) -> None:
    created = await group.http.post("/lmsp/v1/tasks", json=body(MODEL, "Hello", max_output_tokens=2),
                                    headers={"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"})
    assert created.status_code == 202
    log = logged(await _events(group.http, created.json()["id"]))
    assert log[-1].event == "response.incomplete"
    response_id = created.json()["response_id"]

    def found(_: list[ReceivedSpan]) -> bool:
        return any(span.attributes.get("gen_ai.response.id") == response_id and span.service == WORKER
                   for span in receiver.spans)

    await asyncio.to_thread(receiver.wait, found, "")
    request = next(span for span in receiver.spans if span.service == API
                   and span.attributes.get("gen_ai.response.id") == response_id)
    assert request.parent_id == "" and request.trace_id != "0" * 32


async def _events(http: httpx.AsyncClient, task_id: str) -> list[Any]:
    return [event async for event in sse_events(http, "GET", f"/lmsp/v1/tasks/{task_id}/events")]
