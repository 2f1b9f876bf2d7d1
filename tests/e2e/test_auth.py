"""Bearer tokens, scopes per route, object-level access, LMSP_AUTH=none only on loopback, `lmsp token`."""

import re
import subprocess
import sys
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from api.http.app import create_app
from api.http.auth import check_exposure
from lmsp.up import auth_for_up
from lmsp_core.settings import Settings
from lmsp_core.store.tenants import credentials
from lmsp_core.wire.errors import InvalidRequest
from tests.backends import backend, client, eager_worker, make_token, redis, redis_settings, secure, served  # noqa: F401 (fixtures: both deployments)
from tests.support import (
    OPENAI_ROUTES,
    ROOT,
    Api,
    RedisServer,
    TokenFactory,
    assert_problem,
    bearer,
    body,
    free_port,
    run_lmsp,
    service_env,
)

UNKNOWN_TASK = "task_0000000000000000000000000A"
UNKNOWN_WEBHOOK = "wh_0000000000000000000000000A"
WEBHOOK = {"url": "https://8.8.8.8/hook", "events": ["task.completed"]}

# every route and the scope it needs; public routes need none
ROUTES: list[tuple[str, str, str | None]] = [
    ("POST", "/lmsp/v1/responses", credentials.RESPONSES_WRITE),
    ("POST", "/lmsp/v1/tasks", credentials.TASKS_WRITE),
    ("GET", "/lmsp/v1/tasks/{task_id}", credentials.TASKS_READ),
    ("GET", "/lmsp/v1/tasks/{task_id}/events", credentials.TASKS_READ),
    ("POST", "/lmsp/v1/tasks/{task_id}/cancel", credentials.TASKS_WRITE),
    ("GET", "/lmsp/v1/models", credentials.MODELS_READ),
    ("GET", "/lmsp/v1/models/{model_id}", credentials.MODELS_READ),
    ("GET", "/lmsp/v1/tasks", credentials.TASKS_READ),
    ("GET", "/lmsp/v1/responses/{response_id}", credentials.RESPONSES_READ),
    ("DELETE", "/lmsp/v1/responses/{response_id}", credentials.RESPONSES_WRITE),
    ("GET", "/metrics", credentials.MODELS_READ),
    ("GET", "/status", credentials.MODELS_READ),
    ("POST", "/lmsp/v1/webhooks", credentials.WEBHOOKS_MANAGE),
    ("GET", "/lmsp/v1/webhooks", credentials.WEBHOOKS_MANAGE),
    ("GET", "/lmsp/v1/webhooks/{webhook_id}", credentials.WEBHOOKS_MANAGE),
    ("DELETE", "/lmsp/v1/webhooks/{webhook_id}", credentials.WEBHOOKS_MANAGE),
    ("GET", "/lmsp/v1/webhooks/{webhook_id}/deliveries", credentials.WEBHOOKS_MANAGE),
    ("POST", "/lmsp/v1/webhooks/{webhook_id}/test", credentials.WEBHOOKS_MANAGE),
    ("GET", "/healthz", None),
    ("GET", "/readyz", None),
    ("GET", "/", None),
]
# the handlers use Litestar 2 conventions (inferred dependencies, a bare `data`) that 2.25 warns about
@pytest.mark.filterwarnings("ignore::litestar.exceptions.LitestarDeprecationWarning")
def test_every_route_declares_its_scope() -> None:
    app = create_app(Settings())
    declared = {}
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            if handler.http_methods == {"OPTIONS"}:
                continue  # Litestar's automatic OPTIONS answers
            scope = None if handler.opt.get("public") else handler.opt["scope"]
            for method in handler.http_methods:
                declared[(method, route.path.replace(":str}", "}").replace(":path}", "}"))] = scope
    ours = {(method, path): scope for (method, path), scope in declared.items() if not path.startswith("/schema")}
    assert ours == {(method, path): scope for method, path, scope in ROUTES + OPENAI_ROUTES}
    assert all(scope is None for (_, path), scope in declared.items() if path.startswith("/schema"))


def test_the_scope_table_of_the_protocol_doc_tells_the_truth() -> None:
    """docs/protocol.md lists each route with the scope it needs; the list above is checked against
    the app's routes."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    table = text[text.index("**Scopes per route.**"):text.index("**`LMSP_AUTH`.**")]
    documented = {}
    row = r"^\| `(GET|POST|DELETE) (\S+)`[^|]* \| (`[a-z]+:[a-z]+`|public)"
    for method, path, scope in re.findall(row, table, re.M):
        documented[(method, path)] = None if scope == "public" else scope.strip("`")
    assert documented == {(method, path): scope for method, path, scope in ROUTES + OPENAI_ROUTES}
    assert "no route needs" not in text


def _request(method: str, path: str) -> tuple[str, str, dict[str, Any]]:
    url = path.format(task_id=UNKNOWN_TASK, model_id="tiny-random", response_id="resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF",
                      webhook_id=UNKNOWN_WEBHOOK)
    if method != "POST":
        return method, url, {}
    # an endpoint that is never sent to: its principal (the token's, made for the test) has no tasks
    return method, url, {"json": WEBHOOK if path == "/lmsp/v1/webhooks" else body(max_output_tokens=1)}


@pytest.mark.parametrize(("method", "path", "scope"), [r for r in ROUTES if r[2]], ids=[r[1] for r in ROUTES if r[2]])
async def test_missing_and_invalid_tokens_get_401(secure: httpx.AsyncClient, make_token: TokenFactory, method: str,
                                                   path: str, scope: str) -> None:
    method, url, kwargs = _request(method, path)
    missing = assert_problem(await secure.request(method, url, **kwargs), 401, "unauthorized")
    assert "Bearer" in missing["detail"]
    response = await secure.request(method, url, **kwargs)
    assert response.headers["www-authenticate"] == 'Bearer realm="lmsp"'
    for header in ("Bearer lmsp_not-a-real-token", "Bearer", "Basic dXNlcjpwYXNz", "lmsp_x"):
        response = await secure.request(method, url, headers={"Authorization": header}, **kwargs)
        assert_problem(response, 401, "invalid_token")
        assert response.headers["www-authenticate"] == 'Bearer realm="lmsp", error="invalid_token"'


@pytest.mark.parametrize(("method", "path", "scope"), [r for r in ROUTES if r[2]], ids=[r[1] for r in ROUTES if r[2]])
async def test_each_route_needs_its_scope(secure: httpx.AsyncClient, make_token: TokenFactory, method: str,
                                          path: str, scope: str) -> None:
    method, url, kwargs = _request(method, path)
    others, _ = await make_token([s for s in credentials.GRANTABLE if s != scope])
    response = await secure.request(method, url, headers=bearer(others), **kwargs)
    assert_problem(response, 403, "insufficient_scope")
    assert f'scope="{scope}"' in response.headers["www-authenticate"]
    only, _ = await make_token([scope])
    response = await secure.request(method, url, headers=bearer(only), **kwargs)
    assert response.status_code in (200, 201, 202, 404), response.text  # past authorisation (the task is unknown)


async def test_public_routes_and_schema_need_no_token(secure: httpx.AsyncClient) -> None:
    assert (await secure.get("/healthz")).status_code == 200
    assert (await secure.get("/readyz")).status_code == 200
    assert (await secure.get("/schema/openapi.json")).status_code == 200


async def test_tools_execute_is_never_granted(redis: aioredis.Redis) -> None:
    for scopes in (["tools:execute"], ["models:read", "tools:execute"], ["admin"], []):
        with pytest.raises(InvalidRequest):
            await credentials.create(redis, "someone", scopes)
    # even a record written by hand with the reserved scope does not carry it
    token, record = await credentials.create(redis, "someone", ["models:read"])
    forged = credentials.TokenRecord(id=record.id, principal="someone", scopes=["models:read", "tools:execute"],
                                created_at=record.created_at)
    await redis.set(f"lmsp:{{auth}}:token:{credentials.hash_token(token)}", msgspec.json.encode(forged))
    identity = await credentials.authenticate(redis, token)
    assert identity is not None and identity.scopes == frozenset({"models:read"})
    assert await credentials.revoke(redis, record.id)


async def test_tasks_belong_to_their_principal(secure: httpx.AsyncClient, make_token: TokenFactory) -> None:
    alice, _ = await make_token()
    bob, _ = await make_token()
    created = await secure.post("/lmsp/v1/tasks", json=body(model="tiny-unserved"), headers=bearer(alice))
    assert created.status_code == 202
    task_id = created.json()["id"]
    assert (await secure.get(f"/lmsp/v1/tasks/{task_id}", headers=bearer(alice))).status_code == 200
    for method, suffix in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
        theirs = await secure.request(method, f"/lmsp/v1/tasks/{task_id}{suffix}", headers=bearer(bob))
        unknown = await secure.request(method, f"/lmsp/v1/tasks/{UNKNOWN_TASK}{suffix}", headers=bearer(bob))
        problem = assert_problem(theirs, 404, "task_not_found")
        # the same answer as for an id that does not exist, but for the id itself
        assert problem == unknown.json() | {"detail": unknown.json()["detail"].replace(UNKNOWN_TASK, task_id)}
    # bob's cancel changed nothing
    assert (await secure.get(f"/lmsp/v1/tasks/{task_id}", headers=bearer(alice))).json()["status"] == "queued"
    await secure.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=bearer(alice))


async def test_cached_prompt_prefixes_are_not_shared_between_principals(secure: httpx.AsyncClient,
                                                                           make_token: TokenFactory) -> None:
    alice, _ = await make_token()
    bob, _ = await make_token()

    async def usage(token: str) -> dict[str, Any]:
        response = await secure.post("/lmsp/v1/responses", headers=bearer(token),
                                     json=body(text="Alice's secret plans for the weekend", max_output_tokens=3))
        assert response.status_code == 200, response.text
        return dict(response.json()["usage"])

    first, again, bobs = await usage(alice), await usage(alice), await usage(bob)
    assert "input_tokens_details" not in first
    assert again["input_tokens_details"] == {"cached_tokens": again["input_tokens"] - 1}
    assert "input_tokens_details" not in bobs  # a fast first token would tell bob how alice's prompt began


async def test_token_cli_create_list_revoke(secure_api: Api, secure: httpx.AsyncClient,
                                            redis_server: RedisServer, redis: aioredis.Redis) -> None:
    env = service_env(redis_server.url)

    def lmsp(*args: str) -> subprocess.CompletedProcess[str]:
        return run_lmsp("token", *args, env=env)

    created = lmsp("create", "--principal", "cli-user", "--scopes", "models:read,tasks:read")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("lmsp_") and "\n" not in token
    assert (await secure.get("/lmsp/v1/models", headers=bearer(token))).status_code == 200
    assert_problem(await secure.post("/lmsp/v1/tasks", json=body(), headers=bearer(token)), 403, "insufficient_scope")
    # Redis holds the hash, never the token
    for key in await redis.keys("*"):
        assert token.encode() not in key
        if await redis.type(key) == b"string":
            assert token.encode() not in (await redis.get(key) or b"")
    listing = lmsp("list")
    line = next(line for line in listing.stdout.splitlines() if "\tcli-user\t" in line)
    token_id = line.split("\t")[0]
    assert line.split("\t")[2] == "models:read,tasks:read" and token not in listing.stdout
    assert lmsp("create", "--principal", "x", "--scopes", "tools:execute").returncode == 2
    assert lmsp("create", "--principal", "bad name", "--scopes", "models:read").returncode == 2
    assert lmsp("revoke", token_id).returncode == 0
    assert_problem(await secure.get("/lmsp/v1/models", headers=bearer(token)), 401, "invalid_token")
    assert lmsp("revoke", token_id).returncode == 1
    assert token_id not in lmsp("list").stdout


def test_auth_none_is_refused_off_loopback(redis_server: RedisServer) -> None:
    with pytest.raises(SystemExit, match="refusing to start"):
        check_exposure(Settings(auth="none", host="0.0.0.0"))
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_exposure(Settings(auth="none", host=host))
    check_exposure(Settings(auth="tokens", host="0.0.0.0"))
    # the real command exits before it listens
    port = free_port()
    env = service_env(redis_server.url, auth="none")
    result = subprocess.run([sys.executable, "-m", "lmsp.cli", "api", "--host", "0.0.0.0", "--port", str(port)],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "refusing to start" in result.stderr and "Traceback" not in result.stderr


def test_lmsp_up_chooses_auth_by_address() -> None:
    assert auth_for_up(Settings(host="127.0.0.1"), {}).auth == "none"
    assert auth_for_up(Settings(host="0.0.0.0"), {}).auth == "tokens"
    assert auth_for_up(Settings(host="192.168.1.5"), {}).auth == "tokens"
    assert auth_for_up(Settings(host="127.0.0.1", auth="tokens"), {"LMSP_AUTH": "tokens"}).auth == "tokens"


async def test_auth_none_acts_for_local_and_is_logged(api: Api, client: httpx.AsyncClient) -> None:
    # an Authorization header changes nothing when authentication is off
    response = await client.get("/lmsp/v1/models", headers={"Authorization": "Bearer whatever"})
    assert response.status_code == 200
    assert "authentication is off (LMSP_AUTH=none)" in api.output()
