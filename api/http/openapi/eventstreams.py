"""OpenAPI descriptions of the event streams (``text/event-stream`` answers).

OpenAPI 3.1 has no type for a stream: tools (schemathesis, client generators) read the schema of a
``text/event-stream`` media type as that of each event, parsed as the WHATWG parser does, an
object with ``event`` (``message`` when the frame names none), ``data`` (a string) and ``id`` (the
last id seen, if any). Each event name is tied here to the JSON Schema of its data
(``contentMediaType`` and ``contentSchema``), generated from the msgspec types that encode it, so
the document cannot drift from what is sent.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar.openapi.spec import Example, OpenAPIMediaType, OpenAPIResponse, Operation, Parameter, Schema

MEDIA_TYPE = "text/event-stream"
JsonSchema = dict[str, Any]


@dataclass
class RawSchema(Schema):
    """A JSON Schema written into the document as it is (Litestar's ``Schema`` has no
    ``contentSchema``, which describes the JSON inside a string)."""

    raw: JsonSchema = field(default_factory=dict)

    def to_schema(self) -> dict[str, Any]:
        return self.raw


def json_schema(kind: Any) -> JsonSchema:
    """msgspec's JSON Schema of ``kind`` (what its decoder accepts and its encoder writes), with
    every ``$ref`` replaced by its definition: a self-contained schema, apart from the document's
    components (which Litestar names)."""
    schema = msgspec.json.schema(kind)
    definitions = schema.pop("$defs", {})
    inlined: JsonSchema = _inline(schema, definitions)
    return inlined


def _inline(node: Any, definitions: Mapping[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _inline(definitions[ref.removeprefix("#/$defs/")], definitions)
    # a discriminator's mapping names $defs, which are inlined away; `anyOf` alone says the same
    return {key: _inline(value, definitions) for key, value in node.items() if key != "discriminator"}


def json_data(kind: Any) -> JsonSchema:
    """An event's ``data``: a JSON document of type ``kind``."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": json_schema(kind)}


def event_schema(events: Mapping[str, JsonSchema], *, numbered: bool) -> JsonSchema:
    """One event of a stream whose events are ``events`` (name: schema of the data). ``numbered``:
    events carry an ``id``, the event number that a client resumes after."""
    properties: JsonSchema = {"event": {"type": "string", "enum": list(events)}, "data": {"type": "string"}}
    if numbered:
        # absent only on a stream's first events when they are extra ones (task.queued) without id
        properties["id"] = {"type": "string", "pattern": "^[0-9]+$",
                            "description": "The event number: `after` / `Last-Event-ID` of a resuming client."}
    return {"type": "object", "required": ["event", "data"], "properties": properties,
            "oneOf": [{"properties": {"event": {"const": name}, "data": data}} for name, data in events.items()]}


def streaming(description: str, schema: JsonSchema, example: Example,
              parameters: Mapping[str, JsonSchema] | None = None) -> type[Operation]:
    """An operation class whose ``200`` is (also) ``text/event-stream`` with events of ``schema``;
    ``parameters`` replaces the schemas of the named parameters (constraints that document what the
    handler checks itself, so that its own problem codes stay)."""

    @dataclass
    class StreamingOperation(Operation):
        def __post_init__(self) -> None:
            answer = (self.responses or {}).get("200")
            if isinstance(answer, OpenAPIResponse):
                stream = OpenAPIMediaType(schema=RawSchema(raw={**schema, "description": description}),
                                          examples={"events": example})
                answer.content = {**(answer.content or {}), MEDIA_TYPE: stream}
            for parameter in self.parameters or []:
                if isinstance(parameter, Parameter) and parameter.name in (parameters or {}):
                    parameter.schema = RawSchema(raw=(parameters or {})[parameter.name])

    return StreamingOperation
