"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, as vLLM names them: add and
remove LoRA adapters on every worker at run time. Mounted only with
GENQ_ALLOW_RUNTIME_LORA_UPDATING (a path on the workers' disks is a deployment's business)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from api import lora_adapters
from api.deps import StateDep

router = APIRouter(tags=["lora"])


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str  # the adapter's PEFT directory, as the workers see it


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


@router.post("/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: StateDep) -> str:
    """200 once every live worker serves it; 400 naming why a worker cannot."""
    return await lora_adapters.load(state.client, state.cluster, body.lora_name, body.lora_path)


@router.post("/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: StateDep) -> str:
    """200 once no live worker serves it; 400 for one loaded at worker start or unknown."""
    return await lora_adapters.unload(state.client, state.cluster, body.lora_name)
