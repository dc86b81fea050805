"""Gemma 3, text only (`Gemma3ForCausalLM`, config `Gemma3TextConfig`): Gemma 2's layer
plus a per-head (1 + w) RMSNorm of queries and keys before the rotary embedding, and a
RoPE of its own for the sliding-window layers.

transformers 5 keeps one rope_parameters entry per layer type ("full_attention",
"sliding_attention"; older configs: rope_theta / rope_scaling for the full layers and
rope_local_base_freq for the sliding ones). As transformers 5.24's Gemma3Attention,
`attn_logit_softcapping` is not applied (released Gemma 3 configs leave it null);
`final_logit_softcapping` is, where set. A `Gemma3ForConditionalGeneration` checkpoint
(the multimodal one) is not loaded: its text config and weights are nested.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from worker.models.gemma import Gemma2ForCausalLM
from worker.models.rotary import RotaryEmbedding

LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' defaults


def layer_type_rope(hf_config: Any, layer_type: str) -> dict[str, Any]:
    """The flat RoPE settings (`rope_type`, `rope_theta`, ...) of one layer type."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type in params:
        return dict(params[layer_type] or {"rope_type": "default"})
    if layer_type == "sliding_attention":  # older configs
        theta = getattr(hf_config, "rope_local_base_freq", None) or DEFAULT_THETA[layer_type]
        return {"rope_type": "default", "rope_theta": theta}
    flat = dict(params or getattr(hf_config, "rope_scaling", None) or {})
    flat.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or DEFAULT_THETA[layer_type])
    return flat


class LayerTypeRotary:
    """Two RoPE tables, the full layers' and the sliding layers', looked up together: each
    row holds [full | sliding] cos (or sin) side by side, and a layer takes its half."""

    def __init__(self, hf_config: Any, head_dim: int):
        self.tables = [RotaryEmbedding(SimpleNamespace(rope_parameters=layer_type_rope(hf_config, kind),
                                                       max_position_embeddings=hf_config.max_position_embeddings),
                                       head_dim)
                       for kind in LAYER_TYPES]

    def set_max_model_len(self, max_model_len: int) -> None:
        for table in self.tables:
            table.set_max_model_len(max_model_len)

    def reserve(self, length: int, dtype: torch.dtype, device: torch.device | str) -> None:
        for table in self.tables:
            table.reserve(length, dtype, device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 2 x head_dim]: the full layers' table, then the sliding layers'."""
        (cos_full, sin_full), (cos_local, sin_local) = (table.lookup(positions) for table in self.tables)
        return torch.cat((cos_full, cos_local), dim=-1), torch.cat((sin_full, sin_local), dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        needed = max_seq_len if max_seq_len is not None else (int(positions.max()) + 1 if positions.numel() else 0)
        self.reserve(needed, dtype, positions.device)
        return self.lookup(positions)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    default_sliding_pattern = 6  # five sliding layers, then a full one

    @classmethod
    def attention_softcap(cls, hf_config: Any) -> float | None:
        return None  # transformers' Gemma 3 attention ignores attn_logit_softcapping

    @classmethod
    def rotary_for(cls, hf_config: Any, head_dim: int) -> LayerTypeRotary:
        return LayerTypeRotary(hf_config, head_dim)
