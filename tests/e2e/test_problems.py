"""Every error from every route is an application/problem+json document, with tokens on too."""

import httpx
import redis.asyncio as aioredis

from api.http.version import HEADER as VERSION_HEADER
from lmsp_core.store import keys
from tests.support import Api, TokenFactory, assert_problem, bearer, body

UNKNOWN_TASK = "task_0000000000000000000000000B"


async def test_errors_before_and_after_authentication(secure: httpx.AsyncClient, make_token: TokenFactory) -> None:
    token, _ = await make_token(["models:read"])
    auth = bearer(token)
    # before routing: no token needed to learn that a route does not exist
    assert_problem(await secure.get("/nowhere"), 404, "not_found")
    assert_problem(await secure.put("/lmsp/v1/tasks"), 405, "method_not_allowed")
    assert_problem(await secure.get("/lmsp/v1/models", headers={VERSION_HEADER: "9"}), 400, "unsupported_version")
    # authentication comes before the body is read
    assert_problem(await secure.post("/lmsp/v1/tasks", content=b"x" * (5 << 20)), 401, "unauthorized")
    writer, _ = await make_token(["tasks:write"])
    big = await secure.post("/lmsp/v1/tasks", content=b"x" * (5 << 20), headers=bearer(writer))
    assert_problem(big, 413, "request_too_large")
    assert_problem(await secure.post("/lmsp/v1/tasks", json=body(), headers=auth), 403, "insufficient_scope")
    assert_problem(await secure.get("/lmsp/v1/models/nope", headers=auth), 404, "model_not_found")
    assert_problem(await secure.post("/lmsp/v1/tasks", content=b"{", headers=bearer(writer) | {
        "content-type": "application/json"}), 400, "invalid_request")


async def test_an_unexpected_error_is_a_problem_without_details(api: Api, client: httpx.AsyncClient,
                                                                redis: aioredis.Redis) -> None:
    # a task record damaged in Redis (fields missing) makes the handler fail unexpectedly
    await redis.hset(keys.task(UNKNOWN_TASK), mapping={"owner": "local", "kind": "task"})
    try:
        response = await client.get(f"/lmsp/v1/tasks/{UNKNOWN_TASK}")
    finally:
        await redis.delete(keys.task(UNKNOWN_TASK))
    problem = assert_problem(response, 500, "internal_error")
    assert "KeyError" not in response.text and "status" not in problem["detail"]
    assert "unhandled error" in api.output()
