"""GET /lmsp/v1/models: the models served, with capabilities and whether workers serve each one."""

from litestar import Controller, get

from api.http.openapi import document as doc
from api.process import Services
from lmsp_core import wire
from lmsp_core.requests.catalog import ModelSpec
from lmsp_core.store import registry
from lmsp_core.store.tenants import credentials


def model_object(spec: ModelSpec, workers: list[registry.WorkerInfo]) -> wire.ModelObject:
    ready = registry.ready_per_model(workers)[spec.id]
    status: wire.ModelStatus = "available" if ready else \
        "warming" if registry.warming_per_model(workers)[spec.id] else "unavailable"
    return wire.ModelObject(
        id=spec.id, context_window=spec.context_window, max_output_tokens=spec.max_output_tokens,
        capabilities=[*spec.capabilities, *(["reasoning"] if spec.reasoning else [])],
        status=status, workers=ready,
    )


class ModelsController(Controller):
    path = "/lmsp/v1/models"
    tags = ["models"]
    opt = {"scope": credentials.MODELS_READ}

    @get(summary="List models",
         description="The models this deployment serves (a live worker runs them, or the service was configured "
                     "with them; docs/protocol.md, \"Models\") with their context window, output cap, "
                     "capabilities, and whether live workers serve them (`status`: `available`, `warming` while "
                     "their workers warm up, or `unavailable`; `workers`: the ready ones).",
         responses={200: doc.ok(wire.ModelList, "The models", doc.example("Models", wire.ModelList(
             data=[doc.MODEL_OBJECT]))), **doc.problems("service_unavailable", *doc.GUARDED)})
    async def list_models(self, services: Services) -> wire.ModelList:
        workers = await registry.live_workers(services.redis)
        served = services.catalog.listed(registry.models_run(workers))
        return wire.ModelList(data=[model_object(spec, workers) for spec in served])

    # a path, not one segment: ids may have a slash (ORG/NAME, as Hugging Face names models)
    @get("/{model_id:path}", summary="Get a model",
         description="One model of the catalog, listed or not (a task for it waits for a worker).",
         responses={200: doc.ok(wire.ModelObject, "The model", doc.example("A model", doc.MODEL_OBJECT)),
                    **doc.problems("invalid_request", "model_not_found", "service_unavailable", *doc.GUARDED)})
    async def get_model(self, services: Services, model_id: str) -> wire.ModelObject:
        spec = services.catalog.get(model_id.removeprefix("/"))
        return model_object(spec, await registry.live_workers(services.redis))
