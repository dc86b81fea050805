"""GGUF conversion rules of Gemma 2, Gemma 3 (text) and the mixture-of-experts architectures
(Mixtral, i.e. `llama` with experts; `qwen2moe`; `qwen3moe`), as llama.cpp's
convert_hf_to_gguf writes them: tensor names, config metadata, and the transformations to undo.

- Gemma: llama.cpp stores every RMSNorm weight as (w + 1) (transformers' Gemma norm multiplies
  by 1 + w, llama.cpp's by w), so 1 is subtracted back. Gemma's q/k rows are not permuted.
- MoE: the experts of a layer are one stacked tensor [E, rows, cols] per projection
  (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), split here into transformers' per-expert names.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from common.errors import ConfigError

# variant (GGUF architecture, "mixtral" for llama with experts) -> (HF class, transformers model_type)
VARIANTS = {"gemma2": ("Gemma2ForCausalLM", "gemma2"), "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
            "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "mixtral": ("MixtralForCausalLM", "mixtral")}
GEMMA = ("gemma2", "gemma3")

_GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_QWEN_MOE = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj"}
LAYER_TENSORS = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS, "qwen2moe": _QWEN_MOE, "qwen3moe": _QWEN_MOE,
                 "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"}}
# Stacked experts: GGUF part -> HF name with "{e}" for the expert index.
_QWEN_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"}
EXPERT_TENSORS = {"qwen2moe": _QWEN_EXPERTS, "qwen3moe": _QWEN_EXPERTS,
                  "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                              "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                              "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}}
# llama.cpp's default sliding-window layer pattern (every n-th layer global) and its gemma 27B
# detection by layer count, for which the query scale is hidden / heads instead of head_dim.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
# qwen3moe normalises the top-k routing weights, qwen2moe does not, absent expert_weights_norm.
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "mixtral": True}


def variant_of(arch: str, expert_count: int | None) -> str:
    """The conversion variant: the GGUF architecture, or "mixtral" for llama with experts."""
    return "mixtral" if arch == "llama" and (expert_count or 0) > 0 else arch


def shift_back(variant: str, part: str, weight: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's (w + 1) on Gemma's norm weights (q/k norms and output_norm too)."""
    if variant in GEMMA and part.endswith("norm"):
        return weight - np.float32(1.0)
    return weight


def split_experts(hf_template: str, weight: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """[E, rows, cols] -> one (name, [rows, cols]) per expert."""
    if weight.ndim != 3:
        raise ConfigError(f"stacked expert tensor for {hf_template} has shape {weight.shape}, expected 3 dims")
    return [(hf_template.format(e=e), np.ascontiguousarray(weight[e])) for e in range(weight.shape[0])]


def _layer_types(model: Any, variant: str, layers: int) -> list[str]:
    """Which layers slide: GGUF's attention.sliding_window_pattern (a per-layer bool array, or the
    period n: every n-th layer global) when written, else llama.cpp's fixed pattern."""
    pattern = model.arch_field("attention.sliding_window_pattern", _SWA_PERIOD[variant])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ConfigError(f"{model.path}: sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return ["sliding_attention" if slides else "full_attention" for slides in pattern]
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]


def gemma_fields(model: Any, variant: str, fields: dict, rope_scaling: dict | None) -> dict:
    """Gemma 2 / 3 config: soft-capping, window, layer pattern, query scale, per-layer-type rope."""
    layers, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
    head_dim = model.arch_field("attention.key_length", fields["hidden_size"] // heads)
    if model.arch_field("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{model.path}: key_length != value_length is not supported for {variant}")
    big = layers == _LAYERS_27B[variant]
    out = {"head_dim": head_dim, "query_pre_attn_scalar": fields["hidden_size"] // heads if big else head_dim,
           "sliding_window": model.arch_field("attention.sliding_window"),
           "layer_types": _layer_types(model, variant, layers),
           "final_logit_softcapping": model.arch_field("final_logit_softcapping"),
           "attn_logit_softcapping": model.arch_field("attn_logit_softcapping"),
           "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}
    if variant == "gemma2":
        if rope_scaling is not None:
            raise ConfigError(f"{model.path}: rope scaling is not supported for gemma2")
        return out
    theta = fields.pop("rope_theta")  # transformers 5 takes Gemma 3's rope per layer type
    full = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": theta}
    # llama.cpp hard-codes Gemma 3's local rope base 10000 (rope_local_base_freq).
    out["rope_parameters"] = {"full_attention": full,
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return out


def moe_fields(model: Any, variant: str, fields: dict) -> dict:
    """Experts config: count, top-k, expert (and shared expert) widths, top-k normalisation."""
    count, used = model.arch_field("expert_count"), model.arch_field("expert_used_count")
    if not count or not used:
        raise ConfigError(f"{model.path}: a {variant} file needs expert_count and expert_used_count")
    norm = model.arch_field("expert_weights_norm", _NORM_TOPK[variant])
    if variant == "mixtral":
        if not norm:
            raise ConfigError(f"{model.path}: Mixtral without top-k weight normalisation is not supported")
        return {"num_local_experts": count, "num_experts_per_tok": used, "sliding_window": None}
    out = {"num_experts": count, "num_experts_per_tok": used, "norm_topk_prob": bool(norm),
           "moe_intermediate_size": model.arch_field("expert_feed_forward_length", fields["intermediate_size"])}
    if variant == "qwen2moe":
        out["shared_expert_intermediate_size"] = model.arch_field("expert_shared_feed_forward_length", 0)
        out["qkv_bias"] = "blk.0.attn_q.bias" in model.tensor_names
    return out
