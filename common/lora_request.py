"""A request's LoRA adapter (vLLM's LoRARequest): which adapter, by name, and where its
PEFT files are. It travels with the request from the frontend (or the offline LLM) through
the scheduler, whose prefix cache keys blocks by `lora_name`, to the worker, which loads
the adapter from `lora_path` the first time it sees the name."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    lora_name: str  # the served model name of the adapter; two requests share KV only under one name
    lora_int_id: int  # > 0; vLLM's id, kept for its callers (adapters are keyed by name here)
    lora_path: str  # a directory with adapter_config.json and adapter_model.safetensors (PEFT)

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest needs a non-empty lora_name")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id must be at least 1, got {self.lora_int_id}")
