"""The file store (``lmsp_core.store.objects.files``) against the real redis-server: chunks, expiry, owners,
an explicit id written once, listing."""

import asyncio
import uuid

import msgspec
import pytest
import redis.asyncio as aioredis

from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.objects.files import CHUNK_BYTES, FileStore
from lmsp_core.wire import ids
from lmsp_core.wire.errors import NotFound


@pytest.fixture
def files(redis: aioredis.Redis, settings: Settings) -> FileStore:
    return FileStore(redis, msgspec.structs.replace(settings, file_retention=3600.0))


def owner() -> str:
    return f"p-{uuid.uuid4().hex[:12]}"


async def test_a_file_is_chunked_expires_and_reads_back(files: FileStore, redis: aioredis.Redis) -> None:
    data = b"x" * CHUNK_BYTES + b"tail"
    record = await files.create(who := owner(), "batch", "in.jsonl", data, lines=1)
    assert ids.is_id(record.id, ids.FILE) and record.bytes == len(data)
    assert record.expires_at - record.created_at in (3599, 3600, 3601)
    assert await redis.llen(keys.file_content(record.id)) == 2
    for key in (keys.file(record.id), keys.file_content(record.id), keys.owner_files(who)):
        assert 3590_000 < await redis.pttl(key) <= 3600_000, key
    assert await files.read(record.id) == data
    assert b"".join([chunk async for chunk in files.chunks(record.id)]) == data
    assert await files.get(record.id, who) == record
    assert await files.get(record.id, owner()) is None  # another owner's file does not exist for it
    assert not await files.delete(record.id, owner())
    assert await files.delete(record.id, who)
    assert await files.read(record.id) is None and await files.get(record.id, who) is None
    assert not await files.delete(record.id, who)
    assert await redis.keys(f"lmsp:file:{{{record.id}}}*") == []  # the staging key was renamed


async def test_an_explicit_id_is_written_once(files: FileStore, redis: aioredis.Redis) -> None:
    file_id = ids.derived_id(ids.FILE, f"{uuid.uuid4()}/output")
    first = await files.create(who := owner(), "batch_output", "out.jsonl", b'{"a": 1}\n', lines=1, file_id=file_id)
    again = await files.create(who, "batch_output", "other.jsonl", b"different\n" * 3, lines=3, file_id=file_id)
    assert again == first and first.id == file_id
    assert await files.read(file_id) == b'{"a": 1}\n'
    assert await redis.keys(f"lmsp:file:{{{file_id}}}:staging:*") == []
    assert await redis.zcard(keys.owner_files(who)) == 1
    empty = await files.create(who, "batch_output", "errors.jsonl", b"", lines=0, file_id=file_id + "0")
    assert await files.read(empty.id) == b"" and await files.read("file_missing") is None


async def test_listing_pages_by_creation_time(files: FileStore, redis: aioredis.Redis) -> None:
    who = owner()
    made = []
    for number in range(5):
        made.append(await files.create(who, "batch" if number % 2 == 0 else "batch_output", f"{number}.jsonl",
                                       b"{}\n", lines=1))
        await asyncio.sleep(0.002)  # distinct creation times (ms)
    newest_first = [record.id for record in reversed(made)]
    page, more = await files.list(who, limit=2)
    assert [record.id for record in page] == newest_first[:2] and more
    page, more = await files.list(who, limit=2, after=page[-1].id)
    assert [record.id for record in page] == newest_first[2:4] and more
    page, more = await files.list(who, limit=2, after=page[-1].id)
    assert [record.id for record in page] == newest_first[4:] and not more
    oldest, more = await files.list(who, limit=10, order="asc", purpose="batch")
    assert [record.id for record in oldest] == [made[0].id, made[2].id, made[4].id] and not more
    await redis.delete(keys.file(made[2].id))  # as if it expired: listings drop it from the index
    assert [record.id for record in (await files.list(who, limit=10))[0]] == [r.id for r in made[::-1] if r != made[2]]
    assert await redis.zscore(keys.owner_files(who), made[2].id) is None
    with pytest.raises(NotFound) as unknown:
        await files.list(who, limit=2, after=made[2].id)
    assert unknown.value.code == "file_not_found" and unknown.value.extra == {"param": "after"}
