"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no biases unless `attention_bias`)
with a mixture-of-experts MLP in the layers `qwen_moe_layer` makes sparse (no shared
expert); transformers applies its `sliding_window` (only set with `use_sliding_window`)
to every layer."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.parallel_layout import TensorShard
from worker.models.llama import LlamaForCausalLM
from worker.models.moe_mlp import MoeMlp
from worker.models.qwen2_moe import qwen_moe_layer, qwen_moe_spec


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @classmethod
    def biases(cls, hf_config: Any) -> dict[str, bool]:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv": attention_bias, "o": attention_bias, "mlp": False}

    @classmethod
    def layer_sliding_windows(cls, hf_config: Any) -> list[int | None]:
        window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", False) else None
        return [window] * hf_config.num_hidden_layers

    def layer_mlp(self, hf_config: Any, layer: int, shard: TensorShard, dtype: torch.dtype | None,
                  device: Any) -> nn.Module | None:
        if not qwen_moe_layer(hf_config, layer):
            return None
        return MoeMlp(qwen_moe_spec(hf_config), hf_config.hidden_size, shard, dtype, device)
