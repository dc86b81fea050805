"""Qwen2: the Llama architecture with q/k/v biases and per-layer sliding windows."""
from __future__ import annotations

from typing import Any

from worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def biases(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv": True, "o": False, "mlp": False}

    @classmethod
    def layer_sliding_windows(cls, hf_config: Any) -> list[int | None]:
        """transformers' rules: no window unless `use_sliding_window`; then the layers
        `layer_types` marks "sliding_attention" or, in configs without `layer_types`,
        layers from `max_window_layers` on."""
        num_layers = hf_config.num_hidden_layers
        window = getattr(hf_config, "sliding_window", None)
        if not getattr(hf_config, "use_sliding_window", False) or window is None:
            return [None] * num_layers
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types:
            return [window if kind == "sliding_attention" else None for kind in layer_types]
        first_sliding = getattr(hf_config, "max_window_layers", num_layers)
        return [window if i >= first_sliding else None for i in range(num_layers)]
