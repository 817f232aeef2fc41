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
    from worker.engine import Engine
    from worker.llm import LLM, RequestsFailed
    from worker.lora_request import LoRARequest
    from worker.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput

__all__ = ["LLM", "Engine", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "BeamSearchParams", "LoRARequest", "RequestOutput", "CompletionOutput", "RequestsFailed",
           "EmbeddingRequestOutput"]

_LAZY = {
    "LLM": "worker.llm",
    "RequestsFailed": "worker.llm",
    "Engine": "worker.engine",
    "LoRARequest": "worker.lora_request",
    "RequestOutput": "worker.outputs",
    "CompletionOutput": "worker.outputs",
    "EmbeddingRequestOutput": "worker.outputs",
    "WorkerSettings": "worker.queue.consumer",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
