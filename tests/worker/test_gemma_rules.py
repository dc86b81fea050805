"""Gemma's rules: both soft-caps change transformers' output (so the logits comparisons in
test_models.VARIANTS would catch one ignored), layer kinds and local RoPE, and what it refuses."""
from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.errors import ConfigError
from tests.worker.test_models import GEMMA_VARIANTS, load_ours, random_sequences
from worker.models import get_model_class


def test_gemma_softcaps_matter(tiny_hf_model) -> None:
    """The soft-capped Gemma variants would pass with a cap ignored if transformers ignored it."""
    hf_model, _ = tiny_hf_model("Gemma2ForCausalLM", **GEMMA_VARIANTS["gemma2_softcaps_tied"][1])
    tokens = random_sequences(hf_model.config.vocab_size)[0]
    with torch.no_grad():
        capped = hf_model(tokens[None]).logits[0]
        hf_model.config.final_logit_softcapping = None
        no_final_cap = hf_model(tokens[None]).logits[0]
        for layer in hf_model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        no_caps = hf_model(tokens[None]).logits[0]
    assert capped.abs().max() < 3.0 < no_final_cap.abs().max()
    # Attention capping alone moves the uncapped logits by far more than test tolerances.
    assert (no_final_cap - no_caps).abs().max() > 0.05 * no_caps.abs().max()


def test_gemma_layer_rules(tiny_hf_model) -> None:
    _, model_dir = tiny_hf_model("Gemma3ForCausalLM", **GEMMA_VARIANTS["gemma3_local_rope"][1])
    model = load_ours(model_dir)[0]
    assert model.sliding_windows == [6, None, 6]
    assert [layer.local_rope for layer in model.layers] == [True, False, True]
    assert model.layers[0].attn_scale == 24 ** -0.5 and model.final_logit_softcapping == 3.0
    assert all(layer.attn_softcap == 0 for layer in model.layers)  # as transformers' Gemma 3
    _, model_dir = tiny_hf_model("Gemma2ForCausalLM", num_hidden_layers=4, attn_logit_softcapping=5.0)
    model = load_ours(model_dir)[0]
    assert model.sliding_windows == [4096, None, 4096, None]  # transformers' default pattern
    assert all(layer.attn_softcap == 5.0 for layer in model.layers)


def test_gemma_rejects_what_it_cannot_run(tiny_hf_model, tmp_path) -> None:
    hf_model, model_dir = tiny_hf_model("Gemma2ForCausalLM")
    config = hf_model.config
    config.hidden_activation = "silu"
    with pytest.raises(ValueError, match="hidden_activation='gelu_pytorch_tanh' only"):
        get_model_class(config)(config)
    from worker.quantization import prepare_linear_weights
    model, _ = load_ours(model_dir)
    with pytest.raises(ConfigError, match="--quantization int8 is not supported for Gemma2ForCausalLM"):
        prepare_linear_weights(model, EngineConfig(model=str(model_dir), device="cpu", quantization="int8"))
