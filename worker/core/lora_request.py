"""Which LoRA adapter a request runs with. Plain data, without torch: the worker's
configuration names adapters before the engine (and torch) is loaded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM names it: `lora_int_id` (>= 1) is the
    adapter's identity in the engine; the same id must always mean the same path."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
