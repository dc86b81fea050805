"""Decoder embedding checkpoints saved as the bare transformer (`Qwen3Model`, as Qwen3-Embedding:
no LM head, tensor names without `model.`): `--runner auto` pools them, LLM.embed equals
transformers' last hidden state of the last token (cosine >= 0.9999 in float32) under chunked
prefill, and `--runner generate` is a clear ConfigError."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from common.errors import ConfigError, InvalidRequestError
from common.pooling_params import BARE_DECODER_ARCHITECTURES
from common.sampling_params import SamplingParams
from pagedserve.offline.llm import LLM
from tiny_models import build_tiny_hf_model
from worker.models import MODEL_REGISTRY, bare_checkpoint_names, get_model_class

SETTINGS = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", attention_backend="torch",
                block_size=4, seed=0, enforce_eager=True)
PROMPTS = [[5], [17, 3, 99, 4, 250], [(7 * i) % 250 + 3 for i in range(13)], [(11 * i) % 250 + 3 for i in range(30)]]


def save_bare(architecture: str, directory) -> torch.nn.Module:
    """A tiny random causal LM's inner transformer (`XModel`) saved alone, as embedding checkpoints are."""
    causal = build_tiny_hf_model(architecture, directory / "causal")
    bare = causal.model
    bare.save_pretrained(directory / "bare")
    return bare


def last_token_reference(bare, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = bare(torch.tensor([prompt])).last_hidden_state[0, -1].float()
    return F.normalize(hidden, dim=-1)


@pytest.mark.parametrize("architecture,bare_name", [("Qwen3ForCausalLM", "Qwen3Model"),
                                                    ("Gemma3ForCausalLM", "Gemma3TextModel")])
def test_bare_decoder_embeds_like_transformers(tmp_path, architecture, bare_name):
    bare = save_bare(architecture, tmp_path)
    directory = tmp_path / "bare"
    assert json.loads((directory / "config.json").read_text())["architectures"] == [bare_name]
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "embed_tokens.weight" in names and "norm.weight" in names
    assert not any(n.startswith("model.") or n.startswith("lm_head") for n in names)

    llm = LLM(model=str(directory), max_num_batched_tokens=8, **SETTINGS)  # runner auto: pooling
    assert llm.worker.model.lm_head is None  # never allocated
    outputs = llm.embed(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        got = torch.tensor(out.outputs.embedding)
        want = last_token_reference(bare, prompt)
        assert got.shape == want.shape
        assert F.cosine_similarity(got, want, dim=0).item() >= 0.9999
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_bare_decoder_refuses_runner_generate(tmp_path):
    save_bare("Qwen3ForCausalLM", tmp_path)
    with pytest.raises(ConfigError, match="no LM head.*--runner pooling"):
        LLM(model=str(tmp_path / "bare"), runner="generate", **SETTINGS)


def test_every_bare_architecture_maps_to_a_registered_class():
    for bare_name, causal_name in BARE_DECODER_ARCHITECTURES.items():
        assert hasattr(transformers, bare_name), bare_name
        assert causal_name in MODEL_REGISTRY
        config = transformers.PretrainedConfig(architectures=[bare_name])
        assert get_model_class(config) is MODEL_REGISTRY[causal_name]
    with pytest.raises(ConfigError, match="unsupported model architecture 'FalconModel'"):
        get_model_class(transformers.PretrainedConfig(architectures=["FalconModel"]))


def test_bare_checkpoint_names_prefix_and_drop_lm_head():
    weights = [("embed_tokens.weight", 1), ("model.layers.0.mlp.up_proj.weight", 2), ("norm.weight", 3),
               ("lm_head.weight", 4)]
    assert list(bare_checkpoint_names(weights)) == [
        ("model.embed_tokens.weight", 1), ("model.layers.0.mlp.up_proj.weight", 2), ("model.norm.weight", 3)]
