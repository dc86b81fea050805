"""Issue 50 acceptance (offline): one batch mixing two PEFT adapters and the base model gives,
for every request, transformers + peft's greedy tokens."""
from __future__ import annotations

import random
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import ConfigError
from common.lora_request import LoRARequest
from common.protocol import EngineRequest
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


def test_an_adapter_that_does_not_fit_fails_only_its_requests(lora_models):
    """The worker reads an adapter when a request first needs it; one whose shapes do not fit the
    model (found only then) makes the step skip that request and report it in StepResult.failed,
    while the rest of the step runs. Here the serving loop's part is played by hand: abort the
    failed request (as the scheduler service does, with a 400 to its client) and go on."""
    root = lora_models
    if not (root / "misshapen").exists():
        shutil.copytree(root / "attn", root / "misshapen")
        tensors = load_file(str(root / "misshapen" / "adapter_model.safetensors"))
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8)
        save_file(tensors, str(root / "misshapen" / "adapter_model.safetensors"))
    llm = LLM(model=str(root / "base"), skip_tokenizer_init=True, dtype="float32", device="cpu",
              attention_backend="torch", block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    adapters = {"full": LoRARequest("full", 1, str(root / "full")),
                "misshapen": LoRARequest("misshapen", 2, str(root / "misshapen")), None: None}
    prompts = {"full": [7, 8, 9, 10, 11, 12], "misshapen": [7, 8, 9, 10, 11, 12, 13], None: [20, 21, 22, 23, 24]}
    for name, prompt in prompts.items():
        llm.scheduler.add_request(EngineRequest(request_id=str(name), prompt_token_ids=prompt,
                                                sampling_params=GREEDY, arrival_time=time.time(),
                                                lora_request=adapters[name]))
    tokens: dict[str, list[int]] = {"full": [], "None": []}
    failed: dict[str, str] = {}
    while llm.scheduler.has_unfinished_requests():
        plan = llm.scheduler.schedule()
        result = llm.worker.execute(plan)
        failed.update(result.failed)
        llm.scheduler.abort_requests(list(result.failed))
        for out in llm.scheduler.update(plan, result):
            tokens[out.request_id] += out.new_token_ids
    assert list(failed) == ["misshapen"] and "q_proj" in failed["misshapen"], failed
    assert llm.scheduler.stats().num_free_blocks == llm.scheduler.stats().num_total_blocks  # none leaked
    for name in ("full", None):
        reference = peft_reference(root / "base", None if name is None else root / name)
        assert tokens[str(name)] == hf_greedy(reference, prompts[name], NEW_TOKENS), name
    again = llm.generate([prompts["full"]], GREEDY, use_tqdm=False, lora_request=adapters["full"])
    assert again[0].outputs[0].token_ids == tokens["full"]  # the engine serves on
