"""The model objects of ``GET /lmsp/v1/models``."""

from typing import Literal

from msgspec import Struct

Capability = Literal["streaming", "tools", "structured_output", "conversations"]


# available: a ready worker serves it; warming: its workers are still warming up (compiling)
ModelStatus = Literal["available", "warming", "unavailable"]


class ModelObject(Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    context_window: int
    max_output_tokens: int
    capabilities: list[str]
    status: ModelStatus
    workers: int


class ModelList(Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelObject]
