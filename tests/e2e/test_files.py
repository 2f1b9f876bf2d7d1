"""OpenAI's Files API (``/v1/files``) with the official ``openai`` package: uploads of batch input
files, retrieval, listing, content, deletion, ownership, and the limits on what an upload holds."""

from collections.abc import AsyncIterator

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.objects.files import CHUNK_BYTES, FileStore
from tests.support import Api, TokenFactory


def jsonl(count: int, padding: int = 0) -> bytes:
    lines = [{"custom_id": f"request-{number}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny-random", "messages": [{"role": "user", "content": "Hi" + " " * padding}]}}
             for number in range(count)]
    return b"".join(msgspec.json.encode(line) + b"\n" for line in lines)


def client(api: Api, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest_asyncio.fixture
async def tenants(secure_api: Api, make_token: TokenFactory) -> AsyncIterator[tuple[openai.AsyncOpenAI, ...]]:
    """SDK clients of two principals, each with every scope, and one that may only read."""
    clients = [client(secure_api, (await make_token())[0]) for _ in range(2)]
    clients.append(client(secure_api, (await make_token(["tasks:read"]))[0]))
    try:
        yield tuple(clients)
    finally:
        for each in clients:
            await each.close()


async def test_a_file_round_trip(sdk: openai.AsyncOpenAI) -> None:
    data = jsonl(4000, padding=500)
    assert len(data) > 2 * CHUNK_BYTES  # its content spans chunks
    created = await sdk.files.create(file=("requests.jsonl", data), purpose="batch")
    assert (created.object, created.purpose, created.filename, created.bytes) == ("file", "batch", "requests.jsonl",
                                                                                  len(data))
    assert created.id.startswith("file_") and created.status == "processed"
    assert created.expires_at == created.created_at + int(Settings().file_retention)
    assert await sdk.files.retrieve(created.id) == created
    content = await sdk.files.content(created.id)
    assert content.content == data and content.response.headers["content-type"] == "application/octet-stream"
    deleted = await sdk.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    for call in (sdk.files.retrieve, sdk.files.content, sdk.files.delete):
        with pytest.raises(openai.NotFoundError) as missing:
            await call(created.id)
        assert missing.value.code == "file_not_found"


async def test_listing_pages_and_ownership(tenants: tuple[openai.AsyncOpenAI, ...]) -> None:
    owner, other, reader = tenants
    made = [await owner.files.create(file=(f"{number}.jsonl", jsonl(1)), purpose="batch") for number in range(4)]
    newest = [file.id for file in made[::-1]]  # created one after the other
    page = await owner.files.list(limit=3)
    assert [file.id for file in page.data] == newest[:3] and page.has_more
    rest = await owner.files.list(limit=3, after=page.data[-1].id)
    assert [file.id for file in rest.data] == newest[3:] and not rest.has_more
    assert [file.id async for file in owner.files.list(limit=3)] == newest  # the SDK's pages, by `after`
    oldest = await owner.files.list(order="asc", limit=2)
    assert [file.id for file in oldest.data] == newest[::-1][:2] and oldest.has_more
    # another principal sees none of them, and cannot read, download or delete one
    assert (await other.files.list()).data == []
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError) as foreign:
            await call(made[0].id)
        assert foreign.value.code == "file_not_found"
    assert (await owner.files.retrieve(made[0].id)).id == made[0].id
    with pytest.raises(openai.NotFoundError) as foreign_cursor:
        await other.files.list(after=made[0].id)
    assert foreign_cursor.value.body["param"] == "after"
    # reading needs tasks:read, uploading and deleting tasks:write
    assert (await reader.files.list()).data == []
    with pytest.raises(openai.PermissionDeniedError):
        await reader.files.create(file=("x.jsonl", jsonl(1)), purpose="batch")
    with pytest.raises(openai.PermissionDeniedError):
        await reader.files.delete(made[0].id)


async def test_batch_output_files_are_listed_by_purpose(tenants: tuple[openai.AsyncOpenAI, ...],
                                                       redis: aioredis.Redis) -> None:
    owner = tenants[0]
    upload = await owner.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    principal = await _principal(redis, upload.id)
    output = await FileStore(redis, Settings()).create(principal, "batch_output", "out.jsonl", b'{"id": 1}\n', lines=1)
    assert [file.id for file in (await owner.files.list(purpose="batch_output")).data] == [output.id]
    assert [file.id for file in (await owner.files.list(purpose="batch")).data] == [upload.id]
    assert [file.id for file in (await owner.files.list()).data] == [output.id, upload.id]
    assert (await owner.files.content(output.id)).content == b'{"id": 1}\n'


async def _principal(redis: aioredis.Redis, file_id: str) -> str:
    owner: bytes = await redis.hget(keys.file(file_id), "owner")
    return owner.decode()


async def test_uploads_are_checked(sdk: openai.AsyncOpenAI) -> None:
    refusals = [
        (("a.jsonl", jsonl(1)), "fine-tune", "unsupported_value", "purpose", "purpose"),
        (("a.jsonl", jsonl(1) + b"not json\n"), "batch", "invalid_file_format", "file", "Line 2"),
        (("a.jsonl", b'{"a": 1}\n\n[1, 2]\n'), "batch", "invalid_file_format", "file", "Line 3"),
        (("a.jsonl", b'{"a": "\xff"}\n'), "batch", "invalid_file_format", "file", "UTF-8"),
        (("a.jsonl", b"\n \n"), "batch", "invalid_file_format", "file", "no requests"),
    ]
    for file, purpose, code, param, said in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.files.create(file=file, purpose=purpose)
        error = refused.value.body
        assert (refused.value.code, error["param"]) == (code, param) and said in error["message"], error
    with pytest.raises(openai.BadRequestError) as unknown:
        await sdk.files.create(file=("a.jsonl", jsonl(1)), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert unknown.value.code == "unsupported_parameter" and "expires_after" in unknown.value.body["param"]


async def test_the_limits_of_an_upload(small_api: Api) -> None:
    """The session's ``small_api``: files of a few KiB, batches of three requests."""
    max_bytes, max_lines = int(small_api.env["LMSP_MAX_FILE_BYTES"]), int(small_api.env["LMSP_MAX_BATCH_LINES"])
    async with client(small_api) as sdk:
        accepted = await sdk.files.create(file=("a.jsonl", jsonl(max_lines)), purpose="batch")
        assert accepted.bytes == len(jsonl(max_lines))
        with pytest.raises(openai.BadRequestError) as lines:
            await sdk.files.create(file=("a.jsonl", jsonl(max_lines + 1)), purpose="batch")
        assert lines.value.code == "too_many_lines"
        # just over the file limit (the form around it is within the body's), then far over the body's
        for size in (max_bytes + 1, 256 * 1024):
            with pytest.raises(openai.APIStatusError) as large:
                await sdk.files.create(file=("a.jsonl", b"{}" + b" " * (size - 3) + b"\n"), purpose="batch")
            assert large.value.status_code == 413 and large.value.code == "file_too_large", size
            assert large.value.body["type"] == "invalid_request_error"
        assert small_api.process is not None and small_api.process.poll() is None
        assert (await sdk.files.retrieve(accepted.id)).id == accepted.id  # and it keeps serving
    async with httpx.AsyncClient(base_url=small_api.url, timeout=30) as http:
        plain = await http.post("/v1/files", json={"purpose": "batch"})  # not a form
        assert plain.status_code == 400 and plain.json()["error"]["code"] == "invalid_request"
