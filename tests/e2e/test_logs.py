"""Logs never contain prompts, outputs or tokens: a canary prompt and canary tokens go through every
path (synchronous, streamed, task and events, refused and invalid requests) and must not appear in
the log files of the API and of the worker that ran them."""

import secrets

import httpx

from tests.support import Api, TokenFactory, Worker, bearer, body, collect


async def test_canaries_never_reach_the_logs(secure_api: Api, secure: httpx.AsyncClient, tiny_worker: Worker,
                                             make_token: TokenFactory) -> None:
    prompt = f"canary-prompt-{secrets.token_hex(8)}"
    token, _ = await make_token()
    bogus = f"lmsp_canary{secrets.token_hex(16)}"
    auth = bearer(token)

    sync = await secure.post("/lmsp/v1/responses", json=body(text=prompt, max_output_tokens=24), headers=auth)
    assert sync.status_code == 200
    output = "".join(part["text"] for item in sync.json()["output"] for part in item["content"])
    streamed = await collect(secure, "POST", "/lmsp/v1/responses", json=body(text=prompt, max_output_tokens=8,
                                                                               stream=True), headers=auth)
    assert streamed[-1].event in ("response.completed", "response.incomplete")
    task = (await secure.post("/lmsp/v1/tasks", json=body(text=prompt, max_output_tokens=8), headers=auth)).json()
    events = await collect(secure, "GET", f"/lmsp/v1/tasks/{task['id']}/events", headers=auth)
    assert events[-1].event in ("response.completed", "response.incomplete")
    assert (await secure.get(f"/lmsp/v1/tasks/{task['id']}", headers=auth)).status_code == 200
    # refused and invalid requests
    assert (await secure.post("/lmsp/v1/responses", json=body(text=prompt), headers=bearer(bogus))).status_code == 401
    assert (await secure.post("/lmsp/v1/responses", json=body(text=prompt, colour=prompt),
                              headers=auth)).status_code == 400
    assert (await secure.post("/lmsp/v1/responses", json=body(text=prompt, max_output_tokens=99_999),
                              headers=auth)).status_code == 400
    assert (await secure.post("/lmsp/v1/tasks", json=body(text=prompt * 600, max_output_tokens=1000),
                              headers=auth)).status_code == 400

    api_log, worker_log = secure_api.output(), tiny_worker.output()
    # the logs are the right ones, and they did record these requests (the access log is on)
    assert '"POST /lmsp/v1/responses HTTP/1.1" 200' in api_log and f"{task['id']}/events" in api_log
    assert task["id"] in worker_log
    for log in (api_log, worker_log):
        assert prompt not in log
        assert token not in log and token[5:] not in log
        assert bogus not in log and bogus[5:] not in log
        if len(output.strip()) >= 12:
            assert output not in log
