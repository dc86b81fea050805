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
