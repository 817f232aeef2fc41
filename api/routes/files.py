"""`/v1/files`: upload a batch's input, read a batch's output (OpenAI's Files API, the part the
Batch API uses)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Response, UploadFile

from api import files
from api.deps import ClientDep, SettingsDep
from api.errors import APIError, invalid_param

router = APIRouter(prefix="/files", tags=["batch"])
READ_CHUNK = 1 << 20


@router.post("", response_model=files.FileObject)
async def upload(
    client: ClientDep,
    settings: SettingsDep,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> files.FileObject:
    """A JSONL file of requests for `POST /v1/batches` (`purpose: batch`)."""
    if purpose != "batch":
        raise invalid_param("purpose", f"purpose must be 'batch' (the files genq keeps are batch inputs), got {purpose!r}")
    data = bytearray()
    while chunk := await file.read(READ_CHUNK):
        data += chunk
        if len(data) > settings.max_file_bytes:
            raise APIError(
                413, f"The file is over the limit of {settings.max_file_bytes} bytes (GENQ_MAX_FILE_BYTES).",
                param="file", code="file_too_large",
            )
    return await files.store(client, bytes(data), file.filename or "upload.jsonl", purpose, settings.file_ttl_s)


@router.get("", response_model=files.FileList)
async def list_files(
    client: ClientDep, purpose: str | None = None, limit: int = 100, after: str | None = None
) -> files.FileList:
    return await files.listing(client, purpose, max(1, min(limit, 10_000)), after)


@router.get("/{file_id}", response_model=files.FileObject)
async def retrieve(file_id: str, client: ClientDep) -> files.FileObject:
    return await files.read(client, file_id)


@router.get("/{file_id}/content")
async def content(file_id: str, client: ClientDep) -> Response:
    return Response(await files.content(client, file_id), media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=files.FileDeleted)
async def delete(file_id: str, client: ClientDep) -> files.FileDeleted:
    return await files.delete(client, file_id)
