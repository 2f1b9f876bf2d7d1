"""Request bodies are decoded as strictly as their wire types say, and documented that way.

Litestar converts a decoded body to the handler's type in msgspec's lax mode, which takes ``"64"``
for 64 and ``0`` for ``false``: values the OpenAPI document (and OpenAI's API) refuse. (``64.0``
for 64 stays accepted: JSON Schema's ``integer`` includes it.) The
``before_request`` hook converts the body strictly first; a body that only the lax conversion
accepts is ``400 invalid_request`` as Litestar words it. Any other invalid body is left to Litestar,
whose errors stay as they were.

Their schemas are msgspec's wherever Litestar's would say less (``StructSchemaFromMsgspec``).
"""

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args, get_type_hints

import msgspec
from litestar import Request

# Litestar 2 (pinned <3) has its Struct schema plugin only in private modules
from litestar._openapi.schema_generation import SchemaCreator
from litestar._openapi.schema_generation.plugins.struct import StructSchemaPlugin
from litestar.enums import RequestEncodingType
from litestar.exceptions import SerializationException, ValidationException
from litestar.openapi.spec import Schema
from litestar.typing import FieldDefinition

from api.http.openapi.eventstreams import JsonSchema, RawSchema, json_schema

_AT = re.compile(r"^(?P<message>.*) - at `\$(?:\.(?P<key>.*))?`$", re.DOTALL)


async def strict_body(request: Request[Any, Any, Any]) -> None:
    field = request.route_handler.parsed_data_field
    if field is None or not field.is_subclass_of(msgspec.Struct) or request.method in {"GET", "HEAD"}:
        return
    if getattr(field.kwarg_definition, "media_type", RequestEncodingType.JSON) != RequestEncodingType.JSON:
        return  # a form (a file upload): no JSON to read, and its body may be large
    try:
        body = await request.json()
    except SerializationException:
        return  # not JSON: Litestar answers that itself
    try:
        msgspec.convert(_integers(body), field.annotation, strict=True)
    except msgspec.ValidationError as strict_error:
        try:
            msgspec.convert(body, field.annotation, strict=False)
        except msgspec.ValidationError:
            return  # Litestar refuses it too, in its own words
        raise ValidationException(detail="Validation failed", extra=[_error(str(strict_error))]) from None


def _integers(value: Any) -> Any:
    """``value`` with every float that has no fractional part as an int: JSON Schema's ``integer``
    takes ``64.0``, and so does the service."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integers(item) for item in value]
    if isinstance(value, dict):
        return {key: _integers(item) for key, item in value.items()}
    return value


def _error(text: str) -> dict[str, str]:
    match = _AT.match(text)
    if match is None:
        return {"message": text, "source": "body"}
    error = {"message": match["message"], "source": "body"}
    if match["key"]:
        error["key"] = match["key"]
    return error


@dataclass(frozen=True)
class StructDoc:
    """What a Struct's JSON Schema cannot say by itself: ``fields`` replaces the schemas of fields
    that the handler decodes later (item by item), ``rules`` are constraints between fields
    (``allOf``)."""

    fields: Mapping[str, JsonSchema] = field(default_factory=dict)
    rules: Sequence[JsonSchema] = ()


class StructSchemaFromMsgspec(StructSchemaPlugin):
    """Litestar's schemas of msgspec Structs, made to say what msgspec decodes: a field whose type
    holds no Struct is described by msgspec's own JSON Schema (Litestar drops some constraints, such
    as ``ge=0`` and those on mapping keys), and a Struct that refuses unknown fields has
    ``additionalProperties: false``. Fields that hold Structs keep Litestar's references to its
    components. ``documented`` adds what a Struct's types cannot say (``StructDoc``)."""

    def __init__(self, documented: Mapping[type, StructDoc] | None = None) -> None:
        self.documented = dict(documented or {})

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: SchemaCreator) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        struct = field_definition.type_
        if struct.__struct_config__.forbid_unknown_fields:
            schema.additional_properties = False
        doc = self.documented.get(struct, StructDoc())
        hints = get_type_hints(struct, include_extras=True)
        for item in msgspec.structs.fields(struct):
            if schema.properties is None:
                break
            if item.name in doc.fields:
                schema.properties[item.encode_name] = RawSchema(raw=dict(doc.fields[item.name]))
            elif not _holds_struct(hints[item.name]):
                schema.properties[item.encode_name] = RawSchema(raw=json_schema(hints[item.name]))
        if doc.rules:
            schema.all_of = [*(schema.all_of or []), *(RawSchema(raw=dict(rule)) for rule in doc.rules)]
        return schema


def _holds_struct(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return True
    return any(_holds_struct(argument) for argument in get_args(annotation))
