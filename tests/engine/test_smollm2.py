"""The default model (SmolLM2-135M-Instruct, from its GGUF) in float32: our greedy
tokens equal transformers' greedy `generate` on the same converted weights."""
from __future__ import annotations

import pytest
import torch

from common.model_files import resolve_model_dir
from common.sampling_params import SamplingParams
from tiny_models import hf_greedy
from pagedserve.offline.llm import LLM

PROMPTS = ["The capital of France is", "def quicksort(arr):\n",
           "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to",
           "Q: What is the largest planet in the solar system?\nA:",
           "Once upon a time, in a small village at the edge of a great forest, there lived",
           "Translate to French: I like apples."]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model_dir("smollm2-135m-instruct")


def test_smollm2_greedy_equals_transformers(model_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    del hf_model

    # A small token budget chunks the longer prompts while others decode.
    llm = LLM(model="smollm2-135m-instruct", dtype="float32", kv_cache_memory=256 << 20,
              max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({PROMPTS[i]!r}) diverged at token {next(k for k in range(len(e)) if g[k] != e[k])}"


@pytest.mark.slow
def test_smollm2_fp8_kv_cache_equals_transformers_over_rounded_kv(model_dir):
    """--kv-cache-dtype fp8 on the default model (float32, scale 1: its K/V stay far inside e4m3's
    +-448): the tokens of transformers with K/V rounded through e4m3 the same way (keys, and the
    queries with them, rotated by the normalized Hadamard matrix first, as the cache stores them)."""
    from scipy.linalg import hadamard
    from transformers import AttentionInterface, AutoTokenizer, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(module, query, key, value, *args, **kwargs):
        rotation = torch.tensor(hadamard(query.shape[-1]), dtype=torch.float32) / query.shape[-1] ** 0.5
        query, key = (t.float() @ rotation for t in (query, key))
        key, value = (t.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(query.dtype) for t in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("rounded_fp8_e4m3", rounded)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="rounded_fp8_e4m3")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(hf_model.eval(), p, NEW_TOKENS) for p in prompts]
    del hf_model

    llm = LLM(model="smollm2-135m-instruct", dtype="float32", kv_cache_dtype="fp8", kv_cache_memory=256 << 20,
              max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    pairs = [(a, b) for g, e in zip(got, expected) for a, b in zip(g, e)]
    # A K/V element that the two computations put on either side of a rounding midpoint moves one
    # e4m3 step (6 %): rare, but it may flip a later near tie and the rest of that sequence with it.
    # Against the unrounded model's tokens the agreement is far lower (a broken cache: near none).
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.8
    stats = llm.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
