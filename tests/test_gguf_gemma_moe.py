"""GGUF files of Gemma 2 / 3 and the mixture-of-experts architectures (Mixtral, Qwen2-MoE,
Qwen3-MoE), written as llama.cpp's convert_hf_to_gguf writes them (norms + 1 for Gemma, experts
stacked [E, rows, cols], llama q/k permuted for Mixtral): converted back they equal the source
checkpoint, and the engine on the .gguf (default --quantization: dequantized) generates
transformers' greedy tokens with its logprobs."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from common.config import EngineConfig
from common.errors import ConfigError
from common.gguf_convert import convert_gguf_to_hf
from common.sampling_params import SamplingParams
from pagedserve.offline.llm import LLM
from test_model_files import llama_cpp_permute, load_converted, tiny_vocab, write_shape, write_tiny_tokenizer
from tiny_models import MOE_SIZES, build_tiny_hf_model, hf_greedy, routing_margins
from worker.quantization import resolved_quantization

GGUF_ARCH = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "MixtralForCausalLM": "llama",
             "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe"}
OVERRIDES = {
    "Gemma2ForCausalLM": dict(sliding_window=6, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                              query_pre_attn_scalar=16, num_hidden_layers=3),
    "Gemma3ForCausalLM": dict(sliding_window=6, query_pre_attn_scalar=16, num_hidden_layers=3,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    **MOE_SIZES,
    # llama.cpp's qwen3moe always normalises the top-k weights, as the real Qwen3-MoE configs ask.
    "Qwen3MoeForCausalLM": {**MOE_SIZES["Qwen3MoeForCausalLM"], "norm_topk_prob": True},
}
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_moe_or_gemma_gguf(path: str, checkpoint: dict[str, np.ndarray], cfg, arch: str) -> None:
    """The GGUF llama.cpp's converter makes of `checkpoint` (the saved HF tensors)."""
    writer = gguf.GGUFWriter(path, arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    write_shape(writer, cfg, head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:
            writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    write_tiny_tokenizer(writer)
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_hidden_layers)
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for hf_name, data in checkpoint.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = hf_name.split(".")
        if ".experts." in hf_name:  # model.layers.L.<mlp>.experts.E.<proj>.weight
            stacked = f"blk.{parts[2]}.{_EXPERT_PARTS[parts[-2]]}.weight"
            experts.setdefault(stacked, []).append((int(parts[-3]), data))
            continue
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        writer.add_tensor(name_map.get_name(hf_name, try_suffixes=(".weight", ".bias")), data)
    for name, per_expert in experts.items():
        writer.add_tensor(name, np.stack([w for _, w in sorted(per_expert, key=lambda x: x[0])]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf_of(tmp_path):
    def make(architecture: str):
        model = build_tiny_hf_model(architecture, tmp_path / "hf", vocab_size=len(tiny_vocab()[0]),
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0, **OVERRIDES[architecture])
        path = str(tmp_path / f"tiny-{GGUF_ARCH[architecture]}.gguf")
        checkpoint = load_file(str(tmp_path / "hf" / "model.safetensors"))
        write_moe_or_gemma_gguf(path, checkpoint, model.config, GGUF_ARCH[architecture])
        return path, model, checkpoint
    return make


CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
               "final_logit_softcapping", "rope_parameters", "tie_word_embeddings", "num_experts",
               "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "shared_expert_intermediate_size", "qkv_bias", "attention_bias", "hidden_activation")


@pytest.mark.parametrize("architecture", list(GGUF_ARCH))
def test_gemma_and_moe_gguf_round_trip_and_run_like_transformers(architecture, tiny_gguf_of, tmp_path):
    path, source, checkpoint = tiny_gguf_of(architecture)
    out = convert_gguf_to_hf(path, str(tmp_path / "converted"), progress=False)
    ours = load_converted(out)
    assert set(ours) == set(checkpoint) - ({"lm_head.weight"} if source.config.tie_word_embeddings else set())
    for name, value in ours.items():
        # Gemma's norms went through w + 1 - 1 in float32: within rounding of w + 1 (2 ** -23 at 1..2).
        shifted = architecture.startswith("Gemma") and name.endswith("norm.weight")
        np.testing.assert_allclose(value, checkpoint[name], rtol=0, atol=2.5e-7 if shifted else 0, err_msg=name)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == [architecture]
    source_config = source.config.to_dict()
    for key in CONFIG_KEYS:
        if key in source_config:
            assert config.get(key) == source_config[key], key

    # The engine on the .gguf itself: dequantized by default for these architectures.
    assert resolved_quantization(EngineConfig(model=path, device="cpu")) == "gguf"  # before the model is known
    prompts = [[5, 70, 259, 261, 100, 3, 42, 17, 9, 33, 120, 61], [7, 8, 200, 31]]
    if architecture in MOE_SIZES:  # no near-tie lets rounding pick another expert
        assert routing_margins(source, torch.tensor([prompts[0]])).min() > 1e-4
    expected = [hf_greedy(source, p, 8) for p in prompts]
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, skip_tokenizer_init=True,
              enforce_eager=True, model_cache_dir=str(tmp_path / "cache"))
    assert llm.worker.quantization == "none"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                  use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    with torch.no_grad():
        for prompt, tokens, output in zip(prompts, expected, outputs):
            logits = source(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
            reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            ours_lp = torch.tensor([step.logprob for step in output.logprobs])
            torch.testing.assert_close(ours_lp, reference, atol=1e-3, rtol=0)


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Qwen2MoeForCausalLM"])
def test_explicit_gguf_quantization_is_refused_for_gemma_and_moe(architecture, tiny_gguf_of, tmp_path):
    path, _, _ = tiny_gguf_of(architecture)
    refusal = "--quantization gguf (is not supported for Gemma2|does not support mixture-of-experts)"
    with pytest.raises(ConfigError, match=refusal):
        LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, quantization="gguf",
            model_cache_dir=str(tmp_path / "cache"))


def test_moe_file_without_its_expert_counts_is_a_config_error():
    from types import SimpleNamespace

    from common.gguf_arch_rules import moe_fields

    metadata = {"expert_count": 4}
    model = SimpleNamespace(path="x.gguf", tensor_names=[], arch_field=lambda key, default=None: metadata.get(key, default))
    with pytest.raises(ConfigError, match="x.gguf: a qwen2moe file needs expert_count and expert_used_count"):
        moe_fields(model, "qwen2moe", {"intermediate_size": 96})
