"""GET /: the playground, one static page (``api/static/playground.html``) with no build step."""

from importlib import resources

from litestar import MediaType, Response, get

_PAGE = resources.files("api").joinpath("static/playground.html")


@get("/", summary="Playground", media_type=MediaType.HTML, include_in_schema=False, opt={"public": True})
async def playground() -> Response[bytes]:
    # read per request: a few kB, and edits show without a restart
    return Response(_PAGE.read_bytes(), media_type=MediaType.HTML, headers={"Cache-Control": "no-cache"})
