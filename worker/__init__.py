"""genq worker: the engine (scheduler, block manager, model runner, sampler, output processor),
the offline `LLM` class, and the Redis consumer hosted by arq.

Imports are lazy so that `import worker` (arq resolves `worker.WorkerSettings`) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from producer.beam_search import BeamSearchParams
from producer.pooling_params import PoolingParams
from producer.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from worker.core.engine import Engine
    from worker.core.lora_request import LoRARequest
    from worker.core.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from worker.llm import LLM, RequestsFailed

__all__ = ["LLM", "Engine", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "BeamSearchParams", "LoRARequest", "RequestOutput", "CompletionOutput", "RequestsFailed",
           "EmbeddingRequestOutput"]

_LAZY = {
    "LLM": "worker.llm",
    "RequestsFailed": "worker.llm",
    "Engine": "worker.core.engine",
    "LoRARequest": "worker.core.lora_request",
    "RequestOutput": "worker.core.outputs",
    "CompletionOutput": "worker.core.outputs",
    "EmbeddingRequestOutput": "worker.core.outputs",
    "WorkerSettings": "worker.queue.consumer",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
