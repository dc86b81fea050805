"""Phi-3's rules: LongRoPE's factor choice, partial rotary, the fused checkpoint tensors under
tensor parallelism, and what it refuses (logits against transformers: test_models.VARIANTS)."""
from __future__ import annotations

import math

import pytest
import torch

from common.parallel_layout import TensorShard
from tests.worker.test_models import VARIANTS, load_ours
from worker.models import get_model_class


def test_longrope_takes_one_set_of_factors_by_max_model_len(tiny_hf_model) -> None:
    """The long factors at every position when max_model_len exceeds original_max_position_embeddings
    (16), else the short ones; each table is transformers' cos/sin for a sequence on that side."""
    hf_model, model_dir = tiny_hf_model("Phi3ForCausalLM", **VARIANTS["phi3_partial_rotary_longrope_long"][1])
    rotary = load_ours(model_dir)[0].rotary
    assert rotary.long_factors  # max_position_embeddings (512) by default
    tables = {}
    for max_model_len, length in ((17, 40), (16, 16)):
        rotary.set_max_model_len(max_model_len)
        cos, sin = rotary.cos_sin(torch.arange(length), torch.float32)
        with torch.no_grad():
            ref_cos, ref_sin = hf_model.model.rotary_emb(torch.zeros(1), torch.arange(length)[None])
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
        tables[rotary.long_factors] = cos
    assert not torch.equal(tables[True][:16], tables[False])


def test_phi3_rules_from_its_config(tiny_hf_model) -> None:
    _, model_dir = tiny_hf_model("Phi3ForCausalLM", **VARIANTS["phi3_longrope_short_window_8"][1])
    model, _ = load_ours(model_dir)
    assert model.sliding_windows == [8, 8]
    assert model.rotary.rotary_dim == 16 and not model.rotary.long_factors
    assert model.rotary.attention_scaling == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    _, model_dir = tiny_hf_model("Phi3ForCausalLM", **VARIANTS["phi3_partial_rotary_tied"][1])
    model, _ = load_ours(model_dir)
    assert model.sliding_windows == [None, None] and model.rotary.rotary_dim == 12


def test_rotary_kernel_only_where_it_rotates_whole_heads(tiny_hf_model) -> None:
    """cpu_ops.rotary_qk rotates every feature of a head: partial rotary stays on apply_rotary."""
    whole, _ = tiny_hf_model("Phi3ForCausalLM")
    partial, _ = tiny_hf_model("Phi3ForCausalLM", **VARIANTS["phi3_partial_rotary_tied"][1])
    qwen3, _ = tiny_hf_model("Qwen3ForCausalLM")
    fits = {name: get_model_class(m.config)(m.config, dtype=torch.bfloat16).rotary_kernel_fits()
            for name, m in (("whole", whole), ("partial", partial), ("qwen3", qwen3))}
    assert fits == {"whole": True, "partial": False, "qwen3": False}
    assert not get_model_class(whole.config)(whole.config, dtype=torch.float32).rotary_kernel_fits()


def test_partial_rotary_is_refused_where_transformers_ignores_it(tiny_hf_model) -> None:
    hf_model, _ = tiny_hf_model("LlamaForCausalLM")
    hf_model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported for this architecture"):
        get_model_class(hf_model.config)(hf_model.config)


def test_phi3_tensor_parallel_ranks_take_their_rows_of_the_fused_tensors(tiny_hf_model) -> None:
    """4 query heads, 2 KV heads, head_dim 16, intermediate 96, two ranks: rank r holds query
    heads 2r and 2r+1, KV head r and MLP columns 48r..48r+47 of the fused checkpoint tensors."""
    hf_model, _ = tiny_hf_model("Phi3ForCausalLM")
    weights = hf_model.state_dict()
    qkv = weights["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = weights["model.layers.1.mlp.gate_up_proj.weight"]
    q, k, v = qkv[:64], qkv[64:96], qkv[96:]
    gate, up = gate_up[:96], gate_up[96:]
    for rank in range(2):
        model = get_model_class(hf_model.config)(hf_model.config, shard=TensorShard(rank, 2))
        model.load_weights(weights.items())
        layer = model.layers[1]
        rows = slice(32 * rank, 32 * rank + 32), slice(16 * rank, 16 * rank + 16), slice(48 * rank, 48 * rank + 48)
        assert torch.equal(layer.qkv_weight, torch.cat([q[rows[0]], k[rows[1]], v[rows[1]]]))
        assert torch.equal(layer.gate_up_weight, torch.cat([gate[rows[2]], up[rows[2]]]))
        assert torch.equal(layer.o_weight, weights["model.layers.1.self_attn.o_proj.weight"][:, rows[0]])


def test_phi3_fused_tensor_of_the_wrong_size_is_named(tiny_hf_model) -> None:
    hf_model, _ = tiny_hf_model("Phi3ForCausalLM")
    model = get_model_class(hf_model.config)(hf_model.config)
    weights = dict(hf_model.state_dict())
    weights["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(120, 64)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj.weight: checkpoint has 120 rows.*"
                                         r"128 \(64 \+ 32 \+ 32\)"):
        model.load_weights(weights.items())


def test_phi3_pre_quantized_checkpoint_is_refused(tiny_hf_model) -> None:
    hf_model, _ = tiny_hf_model("Phi3ForCausalLM")
    hf_model.config.quantization_config = {"quant_method": "compressed-tensors"}
    with pytest.raises(ValueError, match="pre-quantized .* Phi3ForCausalLM checkpoints are not supported"):
        get_model_class(hf_model.config)(hf_model.config)
