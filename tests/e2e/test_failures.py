"""A generation that fails is answered with a problem document (sync), ends with response.failed
(stream and tasks), and leaves the task failed with its error.

The failure is real: the worker for ``tiny-mismatch`` (the session's ``variant_worker``) runs with a
catalog whose context window is smaller than the API's, so the API accepts the request and the worker
refuses it.
"""

import httpx
import openai
import pytest

from lmsp_core import wire
from tests.support import Api, Worker, assert_problem, body, collect, logged


async def test_failed_generation_everywhere(api: Api, variant_worker: Worker) -> None:
    request = body(model="tiny-mismatch", text="a prompt longer than twenty-four tokens " * 3, max_output_tokens=8)
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
        sync = await client.post("/lmsp/v1/responses", json=request)
        problem = assert_problem(sync, 400, "context_length_exceeded")
        assert "24" in problem["detail"]

        stream = await collect(client, "POST", "/lmsp/v1/responses", json=request | {"stream": True})
        assert [e.event for e in stream] == [wire.FAILED]
        assert stream[0].data["status"] == "failed"
        assert stream[0].data["error"]["code"] == "context_length_exceeded"

        task = (await client.post("/lmsp/v1/tasks", json=request)).json()
        log = logged(await collect(client, "GET", f"/lmsp/v1/tasks/{task['id']}/events"))
        assert [(e.id, e.event) for e in log] == [(1, wire.FAILED)]
        final = (await client.get(f"/lmsp/v1/tasks/{task['id']}")).json()
        assert final["status"] == "failed"
        assert final["error"]["code"] == "context_length_exceeded"
        assert final["response"]["status"] == "failed" and final["response"]["error"] == final["error"]


async def test_failed_generation_through_the_openai_routes(api: Api, variant_worker: Worker) -> None:
    text = "a prompt longer than twenty-four tokens " * 3
    async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as sync:
            await sdk.responses.create(model="tiny-mismatch", input=text, max_output_tokens=8)
        assert sync.value.code == "context_length_exceeded" and "24" in sync.value.message
        events = [event async for event in await sdk.responses.create(model="tiny-mismatch", input=text,
                                                                      max_output_tokens=8, stream=True)]
        assert [(event.sequence_number, event.type) for event in events] == [
            (0, "response.created"), (1, "response.failed")]
        error = events[1].response.error
        assert events[1].response.status == "failed" and error is not None
        assert (error.code, error.type) == ("invalid_prompt", "context_length_exceeded")
        with pytest.raises(openai.BadRequestError):
            await sdk.chat.completions.create(model="tiny-mismatch", messages=[{"role": "user", "content": text}])
        with pytest.raises(openai.APIError) as streamed:  # the SDK raises the error object a stream ends with
            async for _ in await sdk.chat.completions.create(
                    model="tiny-mismatch", messages=[{"role": "user", "content": text}], stream=True):
                pass
        assert streamed.value.code == "context_length_exceeded"
