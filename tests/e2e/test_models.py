"""GET /lmsp/v1/models and the model catalog."""

import httpx
import redis.asyncio as aioredis

from lmsp_core.store import registry
from tests.support import assert_problem, body


async def test_models_list_capabilities_and_context_windows(client: httpx.AsyncClient) -> None:
    response = await client.get("/lmsp/v1/models")
    assert response.status_code == 200
    listing = response.json()
    assert listing["object"] == "list"
    models = {m["id"]: m for m in listing["data"]}
    assert {"smollm2:135m-instruct", "tiny-random"} <= set(models)
    tiny = models["tiny-random"]
    assert tiny == {"id": "tiny-random", "object": "model", "context_window": 2048, "max_output_tokens": 1024,
                    "capabilities": tiny["capabilities"], "status": "available", "workers": 1}
    assert "streaming" in tiny["capabilities"]
    assert models["smollm2:135m-instruct"]["context_window"] == 8192


async def test_one_model(client: httpx.AsyncClient) -> None:
    response = await client.get("/lmsp/v1/models/tiny-random")
    assert response.status_code == 200 and response.json()["id"] == "tiny-random"
    assert (await client.get("/lmsp/v1/models/smollm2:135m-instruct")).status_code == 200
    assert_problem(await client.get("/lmsp/v1/models/nope"), 404, "model_not_found")


async def test_a_warming_worker_does_not_make_its_model_available(client: httpx.AsyncClient,
                                                                   redis: aioredis.Redis) -> None:
    # a worker that is still loading and compiling its model heartbeats as warming
    info = registry.new_worker(["tiny-unserved"], "cpu")
    assert info.state == "warming"
    await registry.heartbeat(redis, info, 30)
    try:
        model = (await client.get("/lmsp/v1/models/tiny-unserved")).json()
        assert model["status"] == "warming" and model["workers"] == 0
        workers = {w["id"]: w for w in (await client.get("/status")).json()["workers"]}
        assert workers[info.id]["state"] == "warming"
        ready = (await client.get("/readyz")).json()
        assert ready["warming"] >= 1 and ready["models"]["tiny-unserved"] == 0
        direct = await client.post("/lmsp/v1/responses", json=body(model="tiny-unserved", max_output_tokens=2))
        assert_problem(direct, 503, "model_unavailable")
    finally:
        await registry.deregister(redis, info.id)
    assert (await client.get("/lmsp/v1/models/tiny-unserved")).json()["status"] == "unavailable"
