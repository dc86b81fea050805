"""Issue 50 acceptance (offline): one batch mixing two PEFT adapters and the base model gives,
for every request, transformers + peft's greedy tokens."""
from __future__ import annotations

import random

import pytest

from common.errors import ConfigError
from common.lora_request import LoRARequest
from common.sampling_params import SamplingParams
from peft_adapters import ALL_LINEAR, build_peft_adapter, peft_reference
from tiny_models import build_tiny_hf_model, hf_greedy
from pagedserve.offline.llm import LLM
from common.errors import InvalidRequestError

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    build_tiny_hf_model("LlamaForCausalLM", root / "base")
    # One adapter on attention only (rank 8), one on every supported module (rank 4, rsLoRA).
    build_peft_adapter(root / "base", root / "attn", rank=8, targets=["q_proj", "v_proj", "o_proj"], seed=1)
    build_peft_adapter(root / "base", root / "full", rank=4, targets=ALL_LINEAR, seed=2, use_rslora=True)
    return root


def test_mixed_batch_matches_peft(lora_models):
    root = lora_models
    adapters = {None: None, "attn": LoRARequest("attn", 1, str(root / "attn")),
                "full": LoRARequest("full", 2, str(root / "full"))}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 9, 13, 7, 5, 17, 9, 6)]
    prompts[4] = prompts[1][:]  # one prompt under two adapters: must not share KV blocks
    names = [None, "attn", "full", "attn", "full", None, "full", "attn"]
    llm = LLM(model=str(root / "base"), skip_tokenizer_init=True, dtype="float32", device="cpu",
              attention_backend="torch", block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=[adapters[n] for n in names])
    got = [o.outputs[0].token_ids for o in outputs]
    for name in adapters:
        reference = peft_reference(root / "base", None if name is None else root / name)
        for prompt, tokens, request_name in zip(prompts, got, names):
            if request_name == name:
                assert tokens == hf_greedy(reference, prompt, NEW_TOKENS), (name, prompt)
    assert got[1] != got[4], "two adapters on one prompt gave the same tokens: adapters not applied"

    # A bad adapter path is refused before any work; the engine keeps serving.
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        llm.generate([prompts[0]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("missing", 3, str(root / "nowhere")))
    again = llm.generate([prompts[2]], GREEDY, use_tqdm=False, lora_request=adapters["full"])
    assert again[0].outputs[0].token_ids == got[2]


def test_lora_settings_are_checked(lora_models):
    with pytest.raises(ConfigError, match="max_loras"):
        LLM(model=str(lora_models / "base"), skip_tokenizer_init=True, enable_lora=True, max_loras=0)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(model=str(lora_models / "base"), skip_tokenizer_init=True, enable_lora=True, tensor_parallel_size=2)
