"""GET /lmsp/v1/models and the model catalog."""

import httpx

from tests.test_errors import assert_problem


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
