"""CORS: off by default; configured origins only; credentials never allowed (with `*` or otherwise)."""

import httpx

from api.http.app import cors_config
from lmsp_core.settings import Settings
from tests.support import SECURE_CORS_ORIGIN, TokenFactory, bearer

PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, idempotency-key"}


async def test_cors_is_off_by_default(client: httpx.AsyncClient) -> None:
    origin = {"Origin": "https://app.example"}
    preflight = await client.options("/lmsp/v1/responses", headers=origin | PREFLIGHT)
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in (await client.get("/lmsp/v1/models", headers=origin)).headers


async def test_configured_origins_only(secure: httpx.AsyncClient, make_token: TokenFactory) -> None:
    token, _ = await make_token()
    preflight = await secure.options("/lmsp/v1/responses", headers={"Origin": SECURE_CORS_ORIGIN} | PREFLIGHT)
    assert preflight.status_code in (200, 204)
    assert preflight.headers["access-control-allow-origin"] == SECURE_CORS_ORIGIN
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert {"authorization", "idempotency-key", "content-type"} <= {h.strip() for h in allowed.split(",")}
    assert "access-control-allow-credentials" not in preflight.headers
    response = await secure.get("/lmsp/v1/models", headers={"Origin": SECURE_CORS_ORIGIN} | bearer(token))
    assert response.headers["access-control-allow-origin"] == SECURE_CORS_ORIGIN
    assert "retry-after" in response.headers["access-control-expose-headers"].lower()
    assert "access-control-allow-credentials" not in response.headers
    stranger = await secure.get("/lmsp/v1/models", headers={"Origin": "https://evil.example"} | bearer(token))
    assert "access-control-allow-origin" not in stranger.headers
    refused = await secure.options("/lmsp/v1/responses", headers={"Origin": "https://evil.example"} | PREFLIGHT)
    assert "access-control-allow-origin" not in refused.headers


def test_wildcard_never_allows_credentials() -> None:
    assert cors_config(Settings()) is None
    wildcard = cors_config(Settings(cors_origins="*"))
    assert wildcard is not None and wildcard.is_allow_all_origins and not wildcard.allow_credentials
    listed = cors_config(Settings(cors_origins="https://a.example, https://b.example"))
    assert listed is not None and listed.allow_origins == ["https://a.example", "https://b.example"]
    assert not listed.allow_credentials
