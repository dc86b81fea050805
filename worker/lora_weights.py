"""A PEFT LoRA adapter read from disk and laid out for the model's fused matmuls.

PEFT stores, per targeted linear layer, lora_A [r, in] and lora_B [out, r] under names such as
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`, and in adapter_config.json
the rank `r`, `lora_alpha` (delta = x A^T B^T * alpha / r, or alpha / sqrt(r) with rslora) and
`target_modules`. The model fuses q/k/v and gate/up into one matmul each, so an adapter's
parts of one fused matmul become one A of [parts * rank, in] (the parts' A rows stacked) and one
block-diagonal B of [out, parts * rank] (each part's B in its output rows and its rank columns,
the scaling folded in): the delta of the fused output is then two matmuls, whatever parts the
adapter targets (an untargeted part is zeros).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from common.lora_request import SUPPORTED_TARGETS, WEIGHT_KEY, WEIGHTS_FILE, LoRAAdapterError, read_adapter_config

# The model's fused matmuls (worker.models.llama), in module-id order, with their PEFT parts.
FUSED_MODULES = ("qkv", "o", "gate_up", "down")
MODULE_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}


@dataclass(slots=True)
class LoRAAdapter:
    """`weights[layer][module]`: (A [parts * rank, in], B [out, parts * rank] scaled) or absent."""
    name: str
    path: str
    rank: int
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


def module_shapes(sizes) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per fused module: (input features, output rows of each part), from worker.models.llama.ModelSizes."""
    q, kv = sizes.num_heads * sizes.head_dim, sizes.num_kv_heads * sizes.head_dim
    return {"qkv": (sizes.hidden, (q, kv, kv)), "o": (q, (sizes.hidden,)),
            "gate_up": (sizes.hidden, (sizes.intermediate, sizes.intermediate)),
            "down": (sizes.intermediate, (sizes.hidden,))}


def load_adapter(name: str, path: str, sizes, num_layers: int, max_rank: int, dtype: torch.dtype,
                 has_dense_mlp: bool = True) -> LoRAAdapter:
    """Read the PEFT adapter at `path` for a model of `sizes` (CPU tensors of `dtype`)."""
    from safetensors.torch import load_file
    config = read_adapter_config(path, max_rank)
    rank = config["r"]
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(weights_file)
    except Exception as e:  # a damaged file: safetensors raises its own error types
        raise LoRAAdapterError(f"LoRA adapter {path!r}: unreadable adapter_model.safetensors: {e}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = WEIGHT_KEY.search(key)
        if match is None or match.group(2) not in SUPPORTED_TARGETS:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: unsupported weight {key!r}")
        layer, part, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= num_layers:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: weight {key!r} for layer {layer} of a "
                                   f"{num_layers}-layer model")
        parts.setdefault((layer, part), {})[which] = tensor
    if not has_dense_mlp and any(part in MODULE_PARTS["gate_up"] + MODULE_PARTS["down"] for _, part in parts):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: adapters on the MLP of a mixture-of-experts model "
                               "are not supported")
    shapes = module_shapes(sizes)
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(num_layers)]
    for (layer, part), pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: layer {layer} {part} lacks lora_A or lora_B")
        module = next(m for m, names in MODULE_PARTS.items() if part in names)
        in_features, out_rows = shapes[module]
        index = MODULE_PARTS[module].index(part)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_rows[index], rank):
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: layer {layer} {part}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
                f"the model needs ({rank}, {in_features}) and ({out_rows[index]}, {rank})")
        num_parts = len(out_rows)
        if module not in weights[layer]:
            weights[layer][module] = (torch.zeros(num_parts * rank, in_features, dtype=dtype),
                                      torch.zeros(sum(out_rows), num_parts * rank, dtype=dtype))
        fused_a, fused_b = weights[layer][module]
        row = sum(out_rows[:index])
        fused_a[index * rank:(index + 1) * rank] = a.to(dtype)
        fused_b[row:row + out_rows[index], index * rank:(index + 1) * rank] = (b.float() * scaling).to(dtype)
    return LoRAAdapter(name=name, path=path, rank=rank, weights=weights)
