"""Request bodies are decoded as strictly as their wire types say, and documented that way.

Litestar converts a decoded body to the handler's type in msgspec's lax mode, which takes ``"64"``
for 64 and ``0`` for ``false``: values the OpenAPI document (and OpenAI's API) refuse. The
``before_request`` hook converts the body strictly first; a body that only the lax conversion
accepts is ``400 invalid_request`` as Litestar words it. Any other invalid body is left to Litestar,
whose errors stay as they were.

Structs that refuse unknown fields are documented with ``additionalProperties: false``, which
Litestar leaves out.
"""

import re
from typing import Any

import msgspec
from litestar import Request

# Litestar 2 (pinned <3) has its Struct schema plugin only in private modules
from litestar._openapi.schema_generation import SchemaCreator
from litestar._openapi.schema_generation.plugins.struct import StructSchemaPlugin
from litestar.exceptions import SerializationException, ValidationException
from litestar.openapi.spec import Schema
from litestar.typing import FieldDefinition

_AT = re.compile(r"^(?P<message>.*) - at `\$(?:\.(?P<key>.*))?`$", re.DOTALL)


async def strict_body(request: Request[Any, Any, Any]) -> None:
    field = request.route_handler.parsed_data_field
    if field is None or not field.is_subclass_of(msgspec.Struct) or request.method in {"GET", "HEAD"}:
        return
    try:
        body = await request.json()
    except SerializationException:
        return  # not JSON: Litestar answers that itself
    try:
        msgspec.convert(body, field.annotation, strict=True)
    except msgspec.ValidationError as strict_error:
        try:
            msgspec.convert(body, field.annotation, strict=False)
        except msgspec.ValidationError:
            return  # Litestar refuses it too, in its own words
        raise ValidationException(detail="Validation failed", extra=[_error(str(strict_error))]) from None


def _error(text: str) -> dict[str, str]:
    match = _AT.match(text)
    if match is None:
        return {"message": text, "source": "body"}
    error = {"message": match["message"], "source": "body"}
    if match["key"]:
        error["key"] = match["key"]
    return error


class ClosedStructSchemaPlugin(StructSchemaPlugin):
    """Litestar's schemas of msgspec Structs, with ``additionalProperties: false`` for those that
    refuse unknown fields."""

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: SchemaCreator) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        if field_definition.type_.__struct_config__.forbid_unknown_fields:
            schema.additional_properties = False
        return schema
