"""Qwen3: Qwen2's attention without q/k/v biases (unless `attention_bias`), plus a
per-head RMSNorm of queries and keys before the rotary embedding."""
from __future__ import annotations

from typing import Any

from worker.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qk_norm = True

    @classmethod
    def biases(cls, hf_config: Any) -> dict[str, bool]:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv": attention_bias, "o": attention_bias, "mlp": False}
