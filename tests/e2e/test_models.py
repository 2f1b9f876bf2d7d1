"""GET /lmsp/v1/models and the model catalog, and which models the listings (GET /v1/models too) show."""

import httpx
import redis.asyncio as aioredis

from lmsp_core.store import registry
from tests.support import Api, RedisServer, Worker, assert_problem, body


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


async def _listed(url: str) -> tuple[list[str], list[str]]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        openai_ids = [model["id"] for model in (await http.get("/v1/models")).json()["data"]]
        lmsp_ids = [model["id"] for model in (await http.get("/lmsp/v1/models")).json()["data"]]
    return openai_ids, lmsp_ids


async def test_the_listings_show_the_models_served(redis_server: RedisServer, tiny_worker: Worker,
                                                   redis: aioredis.Redis) -> None:
    """Without configured models an API lists what live workers run (here tiny-random), not the rest of
    the built-in catalog; ``LMSP_LISTED_MODELS`` adds catalog models without a worker."""
    bare, configured = Api(redis_server.url), Api(redis_server.url, listed_models="llama-8b-random")
    try:
        bare.start()
        configured.start()
        running = registry.models_run(await registry.live_workers(redis))
        openai_ids, lmsp_ids = await _listed(bare.url)
        assert openai_ids == lmsp_ids and "tiny-random" in openai_ids and "llama-8b-random" not in openai_ids
        assert set(openai_ids) <= running
        async with httpx.AsyncClient(base_url=bare.url, timeout=30) as http:  # listed or not, a model exists
            assert (await http.get("/v1/models/llama-8b-random")).status_code == 200
        openai_ids, lmsp_ids = await _listed(configured.url)
        assert openai_ids == lmsp_ids and {"tiny-random", "llama-8b-random"} <= set(openai_ids)
        async with httpx.AsyncClient(base_url=configured.url, timeout=30) as http:
            unserved = (await http.get("/lmsp/v1/models/llama-8b-random")).json()
            assert unserved["status"] == "unavailable"
    finally:
        bare.stop()
        configured.stop()
