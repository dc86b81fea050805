"""Qwen2-MoE: Qwen2's attention (q/k/v biases unless `qkv_bias` is false) with a
mixture-of-experts MLP plus a sigmoid-gated shared expert (see moe_mlp) in the sparse
layers; the layers `qwen_moe_layer` leaves dense keep a SiLU MLP of `intermediate_size`."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.parallel_layout import TensorShard
from worker.models.moe_mlp import MoeMlp, MoeSpec
from worker.models.qwen2 import Qwen2ForCausalLM


def qwen_moe_layer(hf_config: Any, layer: int) -> bool:
    """transformers' rule for Qwen2-/Qwen3-MoE: sparse unless in `mlp_only_layers`, when there
    are experts, every `decoder_sparse_step`-th layer (counting from one)."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (layer not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0 and (layer + 1) % step == 0)


def qwen_moe_spec(hf_config: Any, shared_intermediate: int = 0) -> MoeSpec:
    return MoeSpec(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                   intermediate=hf_config.moe_intermediate_size,
                   normalize=bool(getattr(hf_config, "norm_topk_prob", False)), weights_in_model_dtype=True,
                   shared_intermediate=shared_intermediate)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def biases(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv": bool(getattr(hf_config, "qkv_bias", True)), "o": False, "mlp": False}

    def layer_mlp(self, hf_config: Any, layer: int, shard: TensorShard, dtype: torch.dtype | None,
                  device: Any) -> nn.Module | None:
        if not qwen_moe_layer(hf_config, layer):
            return None
        spec = qwen_moe_spec(hf_config, shared_intermediate=hf_config.shared_expert_intermediate_size)
        return MoeMlp(spec, hf_config.hidden_size, shard, dtype, device)
