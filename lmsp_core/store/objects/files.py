"""OpenAI's files (``/v1/files``): uploaded batch input files and the batches' output files, kept in
Redis so that no API process's memory or disk is the only copy.

A file is a hash (``keys.file``: its record) and its content, a list of chunks of ``CHUNK_BYTES``
(``keys.file_content``), so that no file is one huge string and a reader can stream it a chunk
at a time; both share the hash tag ``{file_id}``. Content is written under a staging key first
and renamed into place in the same transaction that writes the record: a reader never meets a
record without its content, and two writers of one explicit id cannot both write it. An owner's
index (``keys.owner_files``) lists them. Retention (``LMSP_FILE_RETENTION``) is key expiry, the
same instant for the record and the content, and the record's ``expires_at``.

Memory: a stored file costs Redis about its own size, no more: each chunk is one entry of the list,
sized so that the entry's header does not push its allocation into the next size class, and the
record and the index entry are a few hundred bytes; docs/protocol.md ("Files (OpenAI)") has the
measured figure. A file is held whole in the API process while it is checked and written
(``LMSP_MAX_FILE_BYTES`` bounds it).
"""

import secrets
import time
from collections.abc import AsyncIterator
from typing import Literal

import msgspec
from redis.asyncio import Redis
from redis.exceptions import WatchError

from lmsp_core.settings import Settings
from lmsp_core.store import keys
from lmsp_core.store.connections import ReplicaWatch, replicated
from lmsp_core.wire import ids
from lmsp_core.wire.errors import NotFound

# a chunk with its list entry's header fits the allocator's 1 MiB size class, where a chunk of
# exactly 1 MiB would take the next, larger one (docs/protocol.md, "Files (OpenAI)")
CHUNK_BYTES = 1024 * 1024 - 64
# index entries read per round trip while listing (a page may skip expired or other purposes' files)
_LIST_STEP = 1000

Order = Literal["asc", "desc"]


class FileRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    owner: str
    purpose: str  # "batch" (uploads) or "batch_output" (a batch's output and error files)
    filename: str
    bytes: int
    created_at: int  # Unix seconds, as OpenAI's file object
    expires_at: int
    lines: int  # non-blank lines: a batch file's requests or results


def _record(raw: dict[bytes, bytes]) -> FileRecord:
    return msgspec.convert({key.decode(): value.decode() for key, value in raw.items()}, FileRecord, strict=False)


class FileStore:
    def __init__(self, redis: Redis, settings: Settings, replicas: ReplicaWatch | None = None) -> None:
        self.redis = redis
        self.ttl_ms = int(settings.file_retention * 1000)
        self.replicas = replicas

    async def upload(self, owner: str, purpose: str, filename: str, data: bytes, *, lines: int) -> FileRecord:
        """Store a client's upload; with the store's ``replicas``, return once they hold it too (or
        the wait timed out), so that a failover keeps what the client is told."""
        record = await self.create(owner, purpose, filename, data, lines=lines)
        if self.replicas is not None:
            await replicated(self.redis, self.replicas, keys.file(record.id))
        return record

    async def create(self, owner: str, purpose: str, filename: str, data: bytes, *, lines: int,
                     file_id: str | None = None) -> FileRecord:
        """Store a file. With an explicit ``file_id`` (the batch driver's output files, whose ids derive
        from the batch's) a second call returns the record the first one stored and writes nothing."""
        if file_id is not None and (existing := await self._load(file_id)) is not None:
            return existing
        now_ms = int(time.time() * 1000)
        expires_ms = now_ms + self.ttl_ms
        record = FileRecord(id=file_id or ids.new_id(ids.FILE), owner=owner, purpose=purpose, filename=filename,
                            bytes=len(data), created_at=now_ms // 1000, expires_at=expires_ms // 1000, lines=lines)
        staging = keys.file_staging(record.id, secrets.token_hex(8))
        await self._stage(staging, data)
        if not await self._publish(record, staging, expires_ms):
            await self.redis.delete(staging)
            return await self._load(record.id) or record  # written meanwhile by another call with this id
        async with self.redis.pipeline(transaction=False) as pipe:
            index = keys.owner_files(owner)
            pipe.zadd(index, {record.id: now_ms})
            pipe.pexpireat(index, expires_ms)  # outlives every file it lists: they share one retention
            await pipe.execute()
        return record

    async def _stage(self, staging: str, data: bytes) -> None:
        view = memoryview(data)
        async with self.redis.pipeline(transaction=False) as pipe:
            for start in range(0, len(data), CHUNK_BYTES):
                pipe.rpush(staging, view[start:start + CHUNK_BYTES])
                if start == 0:  # content whose record is never written (a crash) expires too
                    pipe.pexpire(staging, self.ttl_ms)
            await pipe.execute()

    async def _publish(self, record: FileRecord, staging: str, expires_ms: int) -> bool:
        """Move the staged content into place and write the record, in one transaction; False where a
        record with this id exists (or appeared meanwhile)."""
        record_key = keys.file(record.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(record_key)
                if await pipe.exists(record_key):
                    return False
                pipe.multi()  # type: ignore[no-untyped-call]
                if record.bytes:
                    pipe.rename(staging, keys.file_content(record.id))
                    pipe.pexpireat(keys.file_content(record.id), expires_ms)
                pipe.hset(record_key, mapping=msgspec.structs.asdict(record))
                pipe.pexpireat(record_key, expires_ms)
                await pipe.execute()
            except WatchError:
                return False
        return True

    async def _load(self, file_id: str) -> FileRecord | None:
        raw = await self.redis.hgetall(keys.file(file_id))  # type: ignore[misc]
        return _record(raw) if raw else None

    async def get(self, file_id: str, owner: str) -> FileRecord | None:
        """The owner's file; None for a file that does not exist, has expired or is another owner's."""
        record = await self._load(file_id)
        return record if record is not None and record.owner == owner else None

    async def chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's content a chunk at a time (one round trip each); it ends early if the file is
        deleted or expires meanwhile (a reader that knows the size can tell)."""
        content = keys.file_content(file_id)
        index = 0
        while (chunk := await self.redis.lindex(content, index)) is not None:  # type: ignore[misc]
            yield chunk
            index += 1

    async def read(self, file_id: str) -> bytes | None:
        """A file's whole content, read atomically with its record; None if it does not exist."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.exists(keys.file(file_id))
            pipe.lrange(keys.file_content(file_id), 0, -1)
            exists, chunks = await pipe.execute()
        return b"".join(chunks) if exists else None

    async def delete(self, file_id: str, owner: str) -> bool:
        """Delete the owner's file; False if there is none (another owner's file is not deleted)."""
        if await self.get(file_id, owner) is None:
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.file(file_id))
            pipe.delete(keys.file_content(file_id))
            removed, _ = await pipe.execute()
        await self.redis.zrem(keys.owner_files(owner), file_id)
        return bool(removed)

    async def _present(self, index: str, file_ids: list[str]) -> list[FileRecord]:
        """The records of ``file_ids`` that still exist; the others (expired) leave the index."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in file_ids:
                pipe.hgetall(keys.file(file_id))
            raws = await pipe.execute()
        gone = [file_id for file_id, raw in zip(file_ids, raws, strict=True) if not raw]
        if gone:
            await self.redis.zrem(index, *gone)
        return [_record(raw) for raw in raws if raw]

    # last: below it, ``list`` in an annotation would name this method
    async def list(self, owner: str, *, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                   order: Order = "desc") -> tuple[list[FileRecord], bool]:
        """A page of the owner's files by creation time (``desc``: newest first), of one purpose or all,
        after the file ``after`` names; and whether more follow. An ``after`` that names no file of the
        owner's is ``404 file_not_found``. A page is not a snapshot: files created or removed while a
        client pages may be met twice or missed."""
        index = keys.owner_files(owner)
        desc = order == "desc"
        start = 0
        if after is not None:
            rank = await (self.redis.zrevrank(index, after) if desc else self.redis.zrank(index, after))
            if rank is None:
                raise NotFound(f"after {after!r} names no file of yours.", code="file_not_found",
                               extra={"param": "after"})
            start = rank + 1
        found: list[FileRecord] = []
        while len(found) <= limit:
            step = min(_LIST_STEP, limit + 1 - len(found))
            members = await self.redis.zrange(index, start, start + step - 1, desc=desc)
            if not members:
                break
            present = await self._present(index, [member.decode() for member in members])
            start += len(present)  # the expired ones left the index: the next entries moved up
            found += [record for record in present if purpose is None or record.purpose == purpose]
        return found[:limit], len(found) > limit
