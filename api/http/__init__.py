"""The HTTP face of the API: the Litestar app (``app``), its guards (``auth``), strict bodies
(``strictbodies``), problem documents (``problems``), the version header (``version``), what
handlers are handed (``injection``), the routes (``routes``) and the OpenAPI document
(``openapi``)."""
