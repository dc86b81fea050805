"""Mixtral: Mistral's attention with a mixture-of-experts MLP in every layer (top-k of
`num_local_experts`, weights always renormalised and kept in float32; see moe_mlp)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.parallel_layout import TensorShard
from worker.models.mistral import MistralForCausalLM
from worker.models.moe_mlp import MoeMlp, MoeSpec


class MixtralForCausalLM(MistralForCausalLM):
    def layer_mlp(self, hf_config: Any, layer: int, shard: TensorShard, dtype: torch.dtype | None,
                  device: Any) -> nn.Module | None:
        spec = MoeSpec(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate=hf_config.intermediate_size, normalize=True, weights_in_model_dtype=False,
                       module="block_sparse_moe", expert_names=("w1", "w3", "w2"))
        return MoeMlp(spec, hf_config.hidden_size, shard, dtype, device)
