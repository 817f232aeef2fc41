"""`GET /v1/usage`: tokens metered to the caller's API key, by day and model (every tenant's
when keys are off)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import TENANT, StateDep
from api.errors import invalid_param
from api.usage import MAX_DAYS, read_usage

router = APIRouter(tags=["genq"])


@router.get("/usage")
async def usage(state: StateDep, days: int = 30) -> dict[str, Any]:
    if not 1 <= days <= MAX_DAYS:
        raise invalid_param("days", f"days must be in [1, {MAX_DAYS}], got {days}")
    tenant = TENANT.get()
    rows = await read_usage(state.client, days, tenant)
    return {"object": "list", "tenant": tenant, "data": rows}
