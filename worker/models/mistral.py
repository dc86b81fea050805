"""Mistral: the Llama architecture without biases, optionally with one sliding window on every layer."""
from __future__ import annotations

from typing import Any

from worker.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def biases(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv": False, "o": False, "mlp": False}

    @classmethod
    def layer_sliding_windows(cls, hf_config: Any) -> list[int | None]:
        # transformers' Mistral applies `sliding_window` (None = full attention) to
        # every layer and ignores `layer_types`.
        return [getattr(hf_config, "sliding_window", None)] * hf_config.num_hidden_layers
