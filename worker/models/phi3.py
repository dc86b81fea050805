"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer without biases, whose checkpoints store q/k/v
and gate/up already fused (`self_attn.qkv_proj`, `mlp.gate_up_proj`), with LongRoPE, an
optional partial rotary embedding (Phi-4-mini rotates 3/4 of each head) and, when the config
sets `sliding_window`, that window on every layer (as transformers' Phi3 masks it)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from worker.models.mistral import MistralForCausalLM

# A fused checkpoint tensor -> the per-part names the Llama loader places (TP slicing included).
FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class Phi3ForCausalLM(MistralForCausalLM):
    partial_rotary = True

    def __init__(self, hf_config: Any, **kwargs: Any):
        if getattr(hf_config, "quantization_config", None):
            # Their weight scales are per fused tensor; the int8 loader reads them per q/k/v, gate/up part.
            raise ValueError("pre-quantized (compressed-tensors) Phi3ForCausalLM checkpoints are not supported; "
                             "load the float checkpoint (--quantization int8 quantizes it at load time)")
        super().__init__(hf_config, **kwargs)

    def fused_row_splits(self, part: str) -> list[int]:
        """Rows of each piece of a whole (unsharded) fused checkpoint tensor, in order."""
        config = self.config
        if part == "mlp.gate_up_proj":
            return [config.intermediate_size] * 2
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = self.sizes.head_dim
        return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each fused qkv / gate_up tensor split into its parts,
        so that every tensor-parallel rank takes its own heads and MLP columns of each part."""
        for name, tensor in weights:
            prefix, _, rest = name.rpartition(".layers.")
            index, _, local = rest.partition(".")
            module, _, kind = local.rpartition(".")
            if not prefix or module not in FUSED_PARTS:
                yield name, tensor
                continue
            splits = self.fused_row_splits(module)
            if tensor.shape[0] != sum(splits):
                raise ValueError(f"weight {name}: checkpoint has {tensor.shape[0]} rows, the config's "
                                 f"heads / intermediate_size make {sum(splits)} ({' + '.join(map(str, splits))})")
            for piece_name, piece in zip(FUSED_PARTS[module], tensor.split(splits, dim=0)):
                yield f"{prefix}.layers.{index}.{piece_name}.{kind}", piece

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.split_fused(weights))
