"""The OpenAPI document in one place: the LMSP routes' examples and problems (``document``), event
streams described for OpenAPI (``eventstreams``), the ``/v1`` routes' examples (``openai``) and
their bodies' schemas (``openaibodies``)."""
