"""RoPE scalings that stretch the context (linear, dynamic NTK) raise the model's
length limit by their factor, as vLLM derives max_model_len, and positions past
max_position_embeddings compute what transformers computes there."""
from __future__ import annotations

import random

import pytest

from common.sampling_params import SamplingParams
from tiny_models import build_tiny_hf_model, hf_greedy
from pagedserve.offline.llm import LLM

TRAINED_LEN = 32  # max_position_embeddings of the tiny models


@pytest.mark.parametrize("rope_scaling,expected_limit", [
    ({"rope_type": "linear", "factor": 2.0}, 64),
    ({"rope_type": "dynamic", "factor": 4.0}, 128),
])
def test_stretched_context_is_served_and_matches_transformers(tmp_path, rope_scaling, expected_limit):
    hf_model = build_tiny_hf_model("LlamaForCausalLM", tmp_path / "model", rope_scaling=rope_scaling,
                                   max_position_embeddings=TRAINED_LEN)
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", block_size=4, num_gpu_blocks_override=64,
              max_num_batched_tokens=16, enforce_eager=True, skip_tokenizer_init=True)
    assert llm.max_model_len == expected_limit
    rng = random.Random(0)
    # A prompt inside the trained context whose decode runs past it, and one longer than it.
    prompts = [[rng.randrange(3, 256) for _ in range(length)] for length in (20, 40)]
    new_tokens = 24
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    # Dynamic NTK: transformers rescales a whole prompt by its longest position, so only
    # the prompt that fits the trained context is compared token for token there.
    compared = prompts if rope_scaling["rope_type"] == "linear" else prompts[:1]
    assert got[:len(compared)] == [hf_greedy(hf_model, p, new_tokens) for p in compared]
    assert all(len(tokens) == new_tokens for tokens in got)


def test_llama3_scaling_keeps_the_configured_limit(tmp_path):
    build_tiny_hf_model("LlamaForCausalLM", tmp_path / "model", max_position_embeddings=TRAINED_LEN,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", block_size=4, num_gpu_blocks_override=64,
              enforce_eager=True, skip_tokenizer_init=True)
    assert llm.max_model_len == TRAINED_LEN
