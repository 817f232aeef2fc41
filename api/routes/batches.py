"""`/v1/batches`: run a file of requests as low-priority queue jobs (OpenAI's Batch API)."""

from __future__ import annotations

from fastapi import APIRouter

from api import batches
from api.deps import StateDep
from api.generate import check_rate_limit

router = APIRouter(prefix="/batches", tags=["batch"])


@router.post("", response_model=batches.BatchObject)
async def create(body: batches.CreateBatch, state: StateDep) -> batches.BatchObject:
    """Check every line of `input_file_id`, then run them; a file that does not check out
    gives a batch with status `failed` and its `errors`, as OpenAI's does. Creating one
    counts against the key's requests per minute; its lines do not (they queue a few at a time)."""
    await check_rate_limit(state)
    return await batches.create(state, body)


@router.get("", response_model=batches.BatchList)
async def list_batches(state: StateDep, limit: int = 20, after: str | None = None) -> batches.BatchList:
    return await batches.listing(state, max(1, min(limit, 100)), after)


@router.get("/{batch_id}", response_model=batches.BatchObject)
async def retrieve(batch_id: str, state: StateDep) -> batches.BatchObject:
    return await batches.read(state, batch_id)


@router.post("/{batch_id}/cancel", response_model=batches.BatchObject)
async def cancel(batch_id: str, state: StateDep) -> batches.BatchObject:
    return await batches.cancel(state, batch_id)
