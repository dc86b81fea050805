"""Gemma 2 (`Gemma2ForCausalLM`) on the Llama layer's weights, with Gemma's own layer function.

Numerics follow transformers' modeling_gemma2.py op for op: RMSNorm scales by (1 + w)
in float32 before casting back; the embeddings are multiplied by sqrt(hidden_size)
rounded to the model dtype; four norms per layer (the attention and MLP outputs are
normalized before their residual adds); GeGLU MLP (gelu, tanh approximation); scores
scaled by query_pre_attn_scalar ** -0.5; sliding-window and full layers alternating
(`layer_types`); attention logits soft-capped (`attn_logit_softcapping`, through the
attention backend) and final logits soft-capped (`final_logit_softcapping`, by the
lm_head: worker.lm_head.final_softcap). Gemma 3 (worker.models.gemma3) adds q/k norms
and a second RoPE table for the sliding layers.

Quantized layers (int8, GGUF) are not supported: their kernels fuse SiLU into the MLP.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.parallel_layout import TensorShard, stage_layers
from common.pooling_params import is_bare_decoder_config
from worker.attention.step_context import paged_attention
from worker.models.llama import DecoderLayer, LlamaForCausalLM, ModelSizes, _param, project_qkv, row_parallel
from worker.models.packed_linear import linear, pack_weight, packing_supported
from worker.models.rotary import RotaryEmbedding, apply_rotary

GEMMA_ACTIVATION = "gelu_pytorch_tanh"


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm: normalise and scale by (1 + weight) in float32, then cast back."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


class GemmaDecoderLayer(DecoderLayer):
    """The Llama layer's weights plus the norms before and after the MLP; `input_norm`,
    `post_norm` (after attention), `pre_ff_norm`, `post_ff_norm`. `local_rope`: the layer
    takes the second half of the cos/sin rows (Gemma 3's sliding layers, see gemma3)."""

    def __init__(self, sizes: ModelSizes, biases: dict[str, bool], sliding_window: int | None,
                 dtype: torch.dtype | None, device: Any, layer_index: int, *, qk_norm: bool,
                 attn_scale: float, attn_softcap: float, local_rope: bool):
        super().__init__(sizes, biases, sliding_window, dtype, device, layer_index=layer_index, qk_norm=qk_norm)
        self.pre_ff_norm = _param(sizes.hidden, dtype=dtype, device=device)
        self.post_ff_norm = _param(sizes.hidden, dtype=dtype, device=device)
        self.attn_scale = attn_scale
        self.attn_softcap = attn_softcap  # 0: none
        self.local_rope = local_rope

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return gemma_decoder_layer(self, hidden, cos, sin, self.layer_index)


def gemma_decoder_layer(layer: GemmaDecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        layer_index: int) -> torch.Tensor:
    """One Gemma layer over the batch (a free function for torch.compile, as llama.decoder_layer).
    cos/sin rows hold [global | local] tables side by side when their width is 2 x head_dim."""
    s = layer.sizes
    num_tokens = hidden.shape[0]
    x = gemma_rms_norm(hidden, layer.input_norm, s.eps)
    _, q, k, v = project_qkv(layer, x)
    q = q.reshape(num_tokens, s.num_heads, s.head_dim)
    k = k.reshape(num_tokens, s.num_kv_heads, s.head_dim)
    if layer.q_norm is not None:
        q = gemma_rms_norm(q, layer.q_norm, s.eps)
        k = gemma_rms_norm(k, layer.k_norm, s.eps)
    if cos.shape[-1] != s.head_dim:
        half = slice(s.head_dim, None) if layer.local_rope else slice(0, s.head_dim)
        cos, sin = cos[:, half], sin[:, half]
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(k, cos, sin)
    v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
    attn = paged_attention(q, k, v, layer_index, layer.attn_scale, layer.sliding_window, layer.attn_softcap)
    attn = row_parallel(layer, attn.reshape(num_tokens, -1), layer.o_weight, layer.o_bias, layer.o_packed)
    hidden = hidden + gemma_rms_norm(attn, layer.post_norm, s.eps)

    x = gemma_rms_norm(hidden, layer.pre_ff_norm, s.eps)
    gate, up = linear(x, layer.gate_up_weight, None, layer.gate_up_packed).chunk(2, dim=-1)
    mlp = row_parallel(layer, F.gelu(gate, approximate="tanh") * up, layer.down_weight, None, layer.down_packed)
    return hidden + gemma_rms_norm(mlp, layer.post_ff_norm, s.eps)


def gemma_decoder_layers(layers: Sequence[GemmaDecoderLayer], hidden: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, layer_indices: Sequence[int]) -> torch.Tensor:
    """Consecutive layers in one call (what worker.compiled_forward compiles for Gemma models)."""
    for layer, index in zip(layers, layer_indices):
        hidden = gemma_decoder_layer(layer, hidden, cos, sin, index)
    return hidden


def layer_kinds(hf_config: Any, default_pattern: int) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention": `layer_types`, or in older configs
    every `sliding_window_pattern`-th layer full, the others sliding."""
    kinds = getattr(hf_config, "layer_types", None)
    num_layers = hf_config.num_hidden_layers
    if not kinds:
        pattern = getattr(hf_config, "sliding_window_pattern", None) or default_pattern
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the "
                         f"{num_layers} layers, got {list(kinds)}")
    return list(kinds)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2. Subclass hooks: `qk_norm`, `attention_softcap`, `rotary_for` (Gemma 3)."""

    qk_norm = False
    default_sliding_pattern = 2  # Gemma 2: sliding, full, sliding, full, ...
    layers_function = staticmethod(gemma_decoder_layers)  # compiled by worker.compiled_forward
    quantizable = False  # the int8 / GGUF kernels fuse SiLU into the MLP: see prepare_linear_weights

    def __init__(self, hf_config: Any, *, dtype: torch.dtype | None = None, device: Any = None,
                 shard: TensorShard = TensorShard(), stage: tuple[int, int] = (0, 1)):
        nn.Module.__init__(self)
        activation = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
        if activation != GEMMA_ACTIVATION:
            raise ValueError(f"{type(self).__name__} supports hidden_activation={GEMMA_ACTIVATION!r} only, "
                             f"got {activation!r}")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention (an embedding model's "
                             "attention) is not supported")
        self.config = hf_config
        self.sizes = s = ModelSizes(hf_config, shard)
        self.dtype = dtype or torch.get_default_dtype()
        self.device = torch.device(device or "cpu")
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None) or None
        kinds = layer_kinds(hf_config, self.default_sliding_pattern)
        window = getattr(hf_config, "sliding_window", None)
        self.sliding_windows = [window if kind == "sliding_attention" else None for kind in kinds]
        attn_scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        attn_softcap = float(self.attention_softcap(hf_config) or 0.0)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        biases = {"qkv": attention_bias, "o": attention_bias, "mlp": False}
        self.first_layer, self.end_layer = stage_layers(s.num_layers, *stage)
        self.is_first_stage, self.is_last_stage = stage[0] == 0, stage[0] == stage[1] - 1
        vocab_rows = s.vocab_rows if s.tp_size > 1 else s.vocab
        holds_embeddings = self.is_first_stage or (self.is_last_stage and self.tie_word_embeddings)
        self.embed_tokens = _param(vocab_rows, s.hidden, dtype=dtype, device=device) if holds_embeddings else None
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(s, biases, self.sliding_windows[i], dtype, device, i - self.first_layer,
                              qk_norm=self.qk_norm, attn_scale=attn_scale, attn_softcap=attn_softcap,
                              local_rope=kinds[i] == "sliding_attention")
            for i in range(self.first_layer, self.end_layer))
        self.norm = _param(s.hidden, dtype=dtype, device=device) if self.is_last_stage else None
        self.lm_head = None
        if self.is_last_stage and not is_bare_decoder_config(hf_config):  # a bare model has none: it pools
            self.lm_head = self.embed_tokens if self.tie_word_embeddings else _param(
                vocab_rows, s.hidden, dtype=dtype, device=device)
        self.rotary = self.rotary_for(hf_config, s.head_dim)

    @classmethod
    def attention_softcap(cls, hf_config: Any) -> float | None:
        return getattr(hf_config, "attn_logit_softcapping", None)

    @classmethod
    def rotary_for(cls, hf_config: Any, head_dim: int) -> Any:
        return RotaryEmbedding(hf_config, head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings scaled by sqrt(hidden_size), in the model dtype as transformers rounds it."""
        hidden = super().embed(input_ids)
        return hidden * torch.tensor(self.sizes.hidden ** 0.5, dtype=hidden.dtype, device=hidden.device)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(hidden, self.norm, self.sizes.eps)

    def pack_weights(self) -> bool:
        """Pack the four matmul weights for the CPU kernel's plain matmul (gate/up too: the gated
        packing fuses SiLU, Gemma's MLP takes gelu on the unfused product)."""
        if not self.layers or not packing_supported(self.layers[0].qkv_weight):
            return False
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name + "_packed", pack_weight(getattr(layer, name + "_weight")))
        return True

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, tuple[int, int, int] | None]]:
        targets = super().weight_targets()
        for layer, i in zip(self.layers, range(self.first_layer, self.end_layer)):
            p = f"model.layers.{i}."
            targets[p + "pre_feedforward_layernorm.weight"] = (layer.pre_ff_norm, None)
            targets[p + "post_feedforward_layernorm.weight"] = (layer.post_ff_norm, None)
        return targets
