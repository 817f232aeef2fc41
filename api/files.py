"""Files of the batch API (OpenAI's /v1/files), kept in Redis: one hash per file, holding its
metadata and its content, and a sorted set of the ids by creation time. Uploads are batch
inputs; a finished batch writes its output and error files here. Files expire after
`GENQ_FILE_TTL_S`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from api.errors import not_found
from producer.async_client import AsyncClient
from producer.redis_conn import ordered_writes

PURPOSES = ("batch", "batch_output")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: str = "processed"


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False  # OpenAI's cursor pages: ask again with `after` = the last id


async def store(
    client: AsyncClient, content: bytes, filename: str, purpose: str, ttl_s: int
) -> FileObject:
    now = int(time.time())
    meta = FileObject(
        id=f"file-{uuid.uuid4().hex}", bytes=len(content), created_at=now,
        expires_at=now + ttl_s, filename=filename, purpose=purpose,
    )
    fields: dict[str, Any] = {k: str(v) for k, v in meta.model_dump().items() if v is not None}
    pipe = ordered_writes(client.redis)
    pipe.hset(client.keys.file(meta.id), mapping={**fields, "content": content})
    pipe.expire(client.keys.file(meta.id), ttl_s)
    pipe.zadd(client.keys.files, {meta.id: now})
    await pipe.execute()
    return meta


_META = [f for f in FileObject.model_fields if f != "object"]  # the hash fields besides content
PAGE = 100  # files read per round trip when listing


async def read(client: AsyncClient, file_id: str) -> FileObject:
    """The file's metadata; 404 when there is none."""
    meta = _meta(await client.redis.hmget(client.keys.file(file_id), _META))
    if meta is None:
        raise file_not_found(file_id)
    return meta


def _meta(values: list[bytes | None]) -> FileObject | None:
    """An HMGET of _META; None for a file that is gone."""
    if values[0] is None:
        return None
    fields: dict[str, Any] = {n: v.decode() for n, v in zip(_META, values, strict=True) if v is not None}
    return FileObject(**fields)


async def content(client: AsyncClient, file_id: str) -> bytes:
    data = await client.redis.hget(client.keys.file(file_id), "content")
    if data is None:
        raise file_not_found(file_id)
    return bytes(data)


async def delete(client: AsyncClient, file_id: str) -> FileDeleted:
    pipe = ordered_writes(client.redis)
    pipe.delete(client.keys.file(file_id))
    pipe.zrem(client.keys.files, file_id)
    deleted, _ = await pipe.execute()
    if not deleted:
        raise file_not_found(file_id)
    return FileDeleted(id=file_id, deleted=True)


async def listing(client: AsyncClient, purpose: str | None, limit: int, after: str | None) -> FileList:
    """The newest files first, from just past `after`, read PAGE at a time; ids whose file
    expired are dropped from the index."""
    ids = [i.decode() for i in await client.redis.zrevrange(client.keys.files, 0, -1)]
    if after in ids:
        ids = ids[ids.index(after) + 1:]
    found: list[FileObject] = []
    gone: list[str] = []
    for start in range(0, len(ids), PAGE):
        page = ids[start : start + PAGE]
        pipe = client.redis.pipeline(transaction=False)
        for file_id in page:
            pipe.hmget(client.keys.file(file_id), _META)
        for file_id, values in zip(page, await pipe.execute(), strict=True):
            meta = _meta(values)
            if meta is None:
                gone.append(file_id)
            elif purpose is None or meta.purpose == purpose:
                found.append(meta)
        if len(found) > limit:
            break
    if gone:
        await client.redis.zrem(client.keys.files, *gone)
    return FileList(data=found[:limit], has_more=len(found) > limit)


def file_not_found(file_id: str) -> Exception:
    return not_found(f"No file {file_id!r} (never uploaded, deleted, or expired).", "file_not_found")
