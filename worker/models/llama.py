"""Llama-family decoder (Llama 2/3, and via small subclasses Mistral, Qwen2/3 and the
mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE, whose layers hold an MLP module) over a
flattened, unpadded token batch with a paged KV cache: token ids in, final-norm hidden
states out. The model holds the lm_head weight (`lm_head`, or the tied embeddings); what
turns hidden states into logits and greedy tokens is `worker.lm_head`.

Numerics follow transformers' modeling code op for op (RMSNorm in float32 then
cast back before the weight multiply, rotate_half RoPE, SiLU-gated MLP,
residual adds in the model dtype) so float32 logits agree to rounding. q/k/v
and gate/up are stored fused, each one matmul per layer.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.parallel_layout import TensorShard, stage_layers
from common.pooling_params import is_bare_decoder_config
from worker.distributed import pipeline_parallel
from worker.distributed.tensor_parallel import tp_all_reduce, vocab_parallel_embedding
from worker.kernels import cpu_ops
from worker.attention.metadata import AttentionMetadata
from worker.attention.step_context import paged_attention, step_context
from worker.models.packed_linear import linear, linear_silu, pack_gated, pack_weight, packing_supported
from worker.models.rotary import RotaryEmbedding, apply_rotary
from worker.kv_scales import kv_scale_target
from worker.lora_slots import lora_add


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def _param(*shape: int, dtype: torch.dtype | None, device: Any) -> nn.Parameter:
    # Uninitialised: load_weights fills every parameter or fails.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


PACKED_WEIGHTS = ("qkv", "o", "gate_up", "down")  # a layer's matmul weights: <name>_weight


class DecoderLayer(nn.Module):
    def __init__(self, sizes: "ModelSizes", biases: dict[str, bool], sliding_window: int | None,
                 dtype: torch.dtype | None, device: Any, layer_index: int = 0, qk_norm: bool = False,
                 mlp: nn.Module | None = None):
        """`mlp`: a module taking the place of the dense SiLU MLP (a mixture of experts), or None."""
        super().__init__()
        s = sizes
        self.sizes = s
        self.sliding_window = sliding_window
        self.layer_index = layer_index  # which KV cache the attention call writes and reads
        self.tensor_parallel = s.tp_size > 1  # o_proj and down_proj are row-parallel: sum over the ranks
        # Packed copies of the four matmul weights (see packed_linear); None: plain F.linear.
        for name in PACKED_WEIGHTS:
            self.register_buffer(name + "_packed", None, persistent=False)
        self.lora_enabled = False  # add each token's LoRA adapter delta to the matmuls (worker.lora_slots)
        self.fused_rotary = False  # q/k rotary embedding through the CPU kernel (bf16, see pack_weights)
        qkv_rows = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.input_norm = _param(s.hidden, dtype=dtype, device=device)
        self.qkv_weight = _param(qkv_rows, s.hidden, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_rows, dtype=dtype, device=device) if biases["qkv"] else None
        self.o_weight = _param(s.hidden, s.num_heads * s.head_dim, dtype=dtype, device=device)
        self.o_bias = _param(s.hidden, dtype=dtype, device=device) if biases["o"] else None
        # Per-head RMSNorm of queries and keys before the rotary embedding (Qwen3).
        self.q_norm = _param(s.head_dim, dtype=dtype, device=device) if qk_norm else None
        self.k_norm = _param(s.head_dim, dtype=dtype, device=device) if qk_norm else None
        self.post_norm = _param(s.hidden, dtype=dtype, device=device)
        self.mlp = mlp
        dense = mlp is None
        self.gate_up_weight = _param(2 * s.intermediate, s.hidden, dtype=dtype, device=device) if dense else None
        self.gate_up_bias = (_param(2 * s.intermediate, dtype=dtype, device=device)
                             if dense and biases["mlp"] else None)
        self.down_weight = _param(s.hidden, s.intermediate, dtype=dtype, device=device) if dense else None
        self.down_bias = _param(s.hidden, dtype=dtype, device=device) if dense and biases["mlp"] else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return decoder_layer(self, hidden, cos, sin, self.layer_index)


def decoder_layer(layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  layer_index: int) -> torch.Tensor:
    """One layer over the batch; attention state comes from the step context (see step_context).

    A free function of the layer (its index an argument, not an attribute) so that
    one torch.compile graph serves every group of layers (`decoder_layers`): a graph
    of the whole stack would take several times as long to compile, on every start."""
    s = layer.sizes
    num_tokens = hidden.shape[0]
    x = rms_norm(hidden, layer.input_norm, s.eps)
    qkv, q, k, v = project_qkv(layer, x, layer_index)
    if layer.q_norm is not None:
        q = rms_norm(q.reshape(num_tokens, s.num_heads, s.head_dim), layer.q_norm, s.eps)
        k = rms_norm(k.reshape(num_tokens, s.num_kv_heads, s.head_dim), layer.k_norm, s.eps)
    if layer.fused_rotary:  # (never with q/k norms: the kernel reads q and k from the fused qkv rows)
        q, k = cpu_ops.rotary_qk(qkv, cos, sin, s.num_heads, s.num_kv_heads)
    else:
        q = apply_rotary(q.view(num_tokens, s.num_heads, s.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, s.num_kv_heads, s.head_dim), cos, sin)
    v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
    attn = paged_attention(q, k, v, layer_index, s.head_dim ** -0.5, layer.sliding_window)
    if layer.lora_enabled:
        return lora_layer_rest(layer, hidden, attn.reshape(num_tokens, -1), layer_index)
    hidden = hidden + row_parallel(layer, attn.reshape(num_tokens, -1), layer.o_weight, layer.o_bias, layer.o_packed)

    x = rms_norm(hidden, layer.post_norm, s.eps)
    if layer.mlp is not None:  # the layer's own MLP (worker.models.moe_mlp), all-reduced by it
        return hidden + layer.mlp(x)
    activated = linear_silu(x, layer.gate_up_weight, layer.gate_up_bias, layer.gate_up_packed)
    return hidden + row_parallel(layer, activated, layer.down_weight, layer.down_bias, layer.down_packed)


def lora_layer_rest(layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor, layer_index: int) -> torch.Tensor:
    """`decoder_layer` after attention with LoRA deltas on o, gate/up (unfused: before the activation), down."""
    s = layer.sizes
    o = linear(attn, layer.o_weight, layer.o_bias, layer.o_packed)
    hidden = hidden + lora_add(o, attn, layer_index, "o")
    x = rms_norm(hidden, layer.post_norm, s.eps)
    if layer.mlp is not None:  # adapters on a mixture-of-experts MLP are refused (worker.lora_weights)
        return hidden + layer.mlp(x)
    gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
    gate, up = lora_add(gate_up, x, layer_index, "gate_up").chunk(2, dim=-1)
    activated = F.silu(gate) * up
    down = linear(activated, layer.down_weight, layer.down_bias, layer.down_packed)
    return hidden + lora_add(down, activated, layer_index, "down")


def project_qkv(layer: DecoderLayer, x: torch.Tensor, layer_index: int = 0) -> tuple[torch.Tensor, ...]:
    """The fused q/k/v projection (plus each token's LoRA delta when enabled) and its three views."""
    s = layer.sizes
    qkv = linear(x, layer.qkv_weight, layer.qkv_bias, layer.qkv_packed)
    if layer.lora_enabled:
        qkv = lora_add(qkv, x, layer_index, "qkv")
    return qkv, *qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim],
                           dim=-1)


def row_parallel(layer: DecoderLayer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias; under tensor parallelism each rank holds some input columns:
    the partial products are summed over the ranks, then the (whole) bias is added once."""
    if not layer.tensor_parallel:
        return linear(x, weight, bias, packed)
    out = tp_all_reduce(linear(x, weight, None, packed))
    return out if bias is None else out + bias


def decoder_layers(layers: Sequence[DecoderLayer], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   layer_indices: Sequence[int]) -> torch.Tensor:
    """Consecutive layers in one call, `decoder_layer` each. Compiled, one graph covers a
    group of layers, so a step passes through dynamo's Python wrappers once per group
    rather than once per layer (see worker.compiled_forward)."""
    for layer, index in zip(layers, layer_indices):
        hidden = decoder_layer(layer, hidden, cos, sin, index)
    return hidden


class ModelSizes:
    """The shape numbers every layer needs, read once from the HF config: per tensor-parallel
    rank, the heads, MLP columns and vocabulary rows that rank holds (`TensorShard`)."""

    def __init__(self, hf_config: Any, shard: TensorShard = TensorShard()):
        self.tp_size = shard.size
        self.hidden: int = hf_config.hidden_size
        self.num_layers: int = hf_config.num_hidden_layers
        total_heads: int = hf_config.num_attention_heads
        total_kv_heads: int = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim: int = getattr(hf_config, "head_dim", None) or self.hidden // total_heads
        self.q_head_start, self.num_heads, self.kv_head_start, self.num_kv_heads = shard.attention_heads(
            total_heads, total_kv_heads)
        self.intermediate_start, self.intermediate = shard.split(hf_config.intermediate_size, "MLP columns")
        self.vocab: int = hf_config.vocab_size
        self.vocab_start, self.vocab_rows, self.vocab_real_rows = shard.vocab(self.vocab)
        self.eps: float = hf_config.rms_norm_eps


class LlamaForCausalLM(nn.Module):
    """Subclasses change only the per-architecture rules: biases and sliding windows."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype | None = None, device: Any = None,
                 shard: TensorShard = TensorShard(), stage: tuple[int, int] = (0, 1)):
        """`shard`: this tensor-parallel rank's part of every layer; `stage`: (pipeline rank,
        pipeline size): the first stage embeds, the last normalizes and holds the lm_head."""
        super().__init__()
        activation = getattr(hf_config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"{type(self).__name__} supports hidden_act='silu' only, got {activation!r}")
        self.config = hf_config
        self.sizes = s = ModelSizes(hf_config, shard)
        self.dtype = dtype or torch.get_default_dtype()
        self.device = torch.device(device or "cpu")
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.sliding_windows = self.layer_sliding_windows(hf_config)
        biases = self.biases(hf_config)
        self.first_layer, self.end_layer = stage_layers(s.num_layers, *stage)
        self.is_first_stage, self.is_last_stage = stage[0] == 0, stage[0] == stage[1] - 1
        vocab_rows = s.vocab_rows if s.tp_size > 1 else s.vocab
        holds_embeddings = self.is_first_stage or (self.is_last_stage and self.tie_word_embeddings)
        self.embed_tokens = _param(vocab_rows, s.hidden, dtype=dtype, device=device) if holds_embeddings else None
        self.layers = nn.ModuleList(
            DecoderLayer(s, biases, self.sliding_windows[i], dtype, device, layer_index=i - self.first_layer,
                         qk_norm=self.qk_norm, mlp=self.layer_mlp(hf_config, i, shard, dtype, device))
            for i in range(self.first_layer, self.end_layer))
        self.norm = _param(s.hidden, dtype=dtype, device=device) if self.is_last_stage else None
        self.lm_head = None
        if self.is_last_stage and not is_bare_decoder_config(hf_config):  # a bare model has none: it pools
            self.lm_head = self.embed_tokens if self.tie_word_embeddings else _param(
                vocab_rows, s.hidden, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(hf_config, s.head_dim, partial_rotary=self.partial_rotary)

    # --- architecture rules (overridden by Mistral / Qwen2 / Qwen3) ------------------
    qk_norm = False  # per-head RMSNorm of q and k (q_norm / k_norm weights of head_dim)
    layers_function = staticmethod(decoder_layers)  # runs a group of layers; compiled by worker.compiled_forward
    partial_rotary = False  # honours partial_rotary_factor < 1 (rotates part of each head)

    @classmethod
    def biases(cls, hf_config: Any) -> dict[str, bool]:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv": attention_bias, "o": attention_bias, "mlp": bool(getattr(hf_config, "mlp_bias", False))}

    @classmethod
    def layer_sliding_windows(cls, hf_config: Any) -> list[int | None]:
        return [None] * hf_config.num_hidden_layers

    def layer_mlp(self, hf_config: Any, layer: int, shard: TensorShard, dtype: torch.dtype | None,
                  device: Any) -> nn.Module | None:
        """The MLP module of (global) layer `layer` in place of the dense one; None: dense."""
        return None

    # --- forward ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: Any) -> torch.Tensor:
        """input_ids/positions [T] -> final-norm hidden states [T, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        self.rotary.reserve(meta.max_seq_len, self.embed_tokens.dtype, input_ids.device)
        with step_context(backend, meta, kv_caches):
            return self.forward_tokens(input_ids, positions)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       layers_fn: Callable[..., torch.Tensor] | None = None, group_size: int = 1,
                       inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The pure tensor part of `forward`: needs an open step context and a rotary
        table covering every position (`rotary.reserve`). `layers_fn` runs the layers
        `group_size` at a time (`layers_function`, or a compiled one); `inputs_embeds`: instead of embed (images)."""
        s = self.sizes
        layers_fn = layers_fn or type(self).layers_function
        if not self.is_first_stage:  # the previous pipeline stage's output
            hidden = pipeline_parallel.receive_hidden(int(input_ids.shape[0]), s.hidden, self.dtype, self.device)
        else:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.lookup(positions)
        for first in range(0, len(self.layers), group_size):
            group = list(self.layers[first:first + group_size])
            hidden = layers_fn(group, hidden, cos, sin, [layer.layer_index for layer in group])
        if not self.is_last_stage:
            pipeline_parallel.send_hidden(hidden)
            return hidden
        return self.final_norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = self.sizes
        if s.tp_size > 1:
            return vocab_parallel_embedding(input_ids, self.embed_tokens, s.vocab_start)
        return F.embedding(input_ids, self.embed_tokens)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm, self.sizes.eps)

    def pack_weights(self) -> bool:
        """Pre-pack the layers' matmul weights for the CPU kernel's matmul (bfloat16 on CPUs with
        AVX512-BF16, float32 on AVX-512 CPUs; see packed_linear), and with them take the MLP
        activation through the CPU kernel; in bfloat16 the rotary embedding too (the same
        rounding as eager, faster than the inductor-compiled versions). Call after load_weights;
        returns whether anything was packed. The lm_head is packed by its strategy (worker.lm_head)."""
        if not self.layers or not packing_supported(self.layers[0].qkv_weight):
            return False
        for layer in self.layers:
            for name in PACKED_WEIGHTS:
                pack = pack_gated if name == "gate_up" else pack_weight
                weight = getattr(layer, name + "_weight")
                if weight is not None:  # (no dense MLP weights in a layer with its own MLP)
                    setattr(layer, name + "_packed", pack(weight))
            if layer.mlp is not None:
                layer.mlp.pack_weights()
            layer.fused_rotary = self.rotary_kernel_fits()
        return True

    def rotary_kernel_fits(self) -> bool:
        """Whether cpu_ops.rotary_qk computes this model's q/k rotation: bfloat16, q and k read
        straight from the fused qkv rows (no q/k norms) and the whole head rotated."""
        return (self.dtype == torch.bfloat16 and not self.qk_norm
                and self.rotary.rotary_dim == self.sizes.head_dim)

    # --- weights ---------------------------------------------------------------------
    def _elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to another pipeline stage than this one."""
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return not self.first_layer <= index < self.end_layer
        return name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, tuple[int, int, int] | None]]:
        """HF checkpoint name -> (the tensor, or fused slice of one, it is copied into; the part
        of the checkpoint tensor this rank takes: (dim, start, length), None for all of it)."""
        s = self.sizes
        hd = s.head_dim
        q_rows, kv_rows = s.num_heads * hd, s.num_kv_heads * hd
        targets: dict[str, tuple[torch.Tensor, tuple[int, int, int] | None]] = {}
        vocab_part = (0, s.vocab_start, s.vocab_real_rows) if s.tp_size > 1 else None
        real = s.vocab_real_rows if s.tp_size > 1 else s.vocab
        if self.embed_tokens is not None:
            targets["model.embed_tokens.weight"] = (self.embed_tokens[:real], vocab_part)
        if self.is_last_stage:
            targets["model.norm.weight"] = (self.norm, None)
            if not self.tie_word_embeddings and self.lm_head is not None:
                targets["lm_head.weight"] = (self.lm_head[:real], vocab_part)
        for layer, i in zip(self.layers, range(self.first_layer, self.end_layer)):
            p = f"model.layers.{i}."
            targets[p + "input_layernorm.weight"] = (layer.input_norm, None)
            targets[p + "post_attention_layernorm.weight"] = (layer.post_norm, None)
            if layer.q_norm is not None:
                targets[p + "self_attn.q_norm.weight"] = (layer.q_norm, None)
                targets[p + "self_attn.k_norm.weight"] = (layer.k_norm, None)
            # (slice of the fused tensor, rows of the checkpoint tensor this rank holds)
            fused = {"self_attn.q_proj": ((0, q_rows), s.q_head_start * hd),
                     "self_attn.k_proj": ((q_rows, q_rows + kv_rows), s.kv_head_start * hd),
                     "self_attn.v_proj": ((q_rows + kv_rows, q_rows + 2 * kv_rows), s.kv_head_start * hd)}
            if layer.mlp is None:
                fused.update({"mlp.gate_proj": ((0, s.intermediate), s.intermediate_start),
                              "mlp.up_proj": ((s.intermediate, 2 * s.intermediate), s.intermediate_start)})
            else:
                targets.update(layer.mlp.weight_targets(p))
            for name, ((lo, hi), start) in fused.items():
                weight, bias = ((layer.qkv_weight, layer.qkv_bias) if name.startswith("self_attn")
                                else (layer.gate_up_weight, layer.gate_up_bias))
                part = (0, start, hi - lo) if s.tp_size > 1 else None
                targets[p + name + ".weight"] = (weight[lo:hi], part)
                if bias is not None:
                    targets[p + name + ".bias"] = (bias[lo:hi], part)
            # Row-parallel: a rank takes the input columns of its heads / MLP columns; the bias is whole.
            row_parallel_weights = [("self_attn.o_proj", layer.o_weight, layer.o_bias, s.q_head_start * hd)]
            if layer.mlp is None:
                row_parallel_weights.append(("mlp.down_proj", layer.down_weight, layer.down_bias,
                                             s.intermediate_start))
            for name, weight, bias, start in row_parallel_weights:
                targets[p + name + ".weight"] = (weight, (1, start, weight.shape[1]) if s.tp_size > 1 else None)
                if bias is not None:
                    targets[p + name + ".bias"] = (bias, None)
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (converting dtype/device); every parameter must be
        provided exactly once and no unknown name may appear."""
        targets = self.weight_targets()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer older checkpoints saved; recomputed from the config
            if kv_scale_target(name) is not None:
                continue  # an 8-bit KV cache's scales: worker.kv_scales reads them
            if name not in targets and self._elsewhere(name):
                continue  # another pipeline stage's weight
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy of the embeddings
            target, part = targets.get(name, (None, None))
            if name in loaded:
                raise ValueError(f"weight {name} appears twice in the checkpoint")
            if target is None:
                unexpected.append(name)
                continue
            if part is not None:
                tensor = tensor.narrow(*part)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model expects {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if self.sizes.tp_size > 1:  # the vocabulary's padding rows (on the last rank): zero
            for tensor in (self.embed_tokens, self.lm_head):
                if tensor is not None:
                    tensor[self.sizes.vocab_real_rows:].zero_()
        if unexpected or missing:
            raise ValueError(f"checkpoint does not match {type(self).__name__}: "
                             f"missing {missing[:10]}{'...' if len(missing) > 10 else ''} "
                             f"unexpected {unexpected[:10]}{'...' if len(unexpected) > 10 else ''}")
