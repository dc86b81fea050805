"""Tensor, pipeline and data parallelism in the offline LLM: the same tokens as one worker.

Each engine with a group runs rank 0 in this process and the other ranks as
`pagedserve worker` child processes (gloo over loopback); each data-parallel
replica but the first is a child process with its own engine. Float32 greedy tokens
must equal one worker's (on these tiny models exactly; the acceptance bound is
99 %, since the all-reduce sums in another order), and every sampled token's
logprob must be within 1e-3 of one worker's, with the same seeded tokens.
"""
from __future__ import annotations

import gc

import pytest

from pagedserve import LLM, SamplingParams
from tiny_models import MOE_SIZES, build_tiny_hf_model

PROMPTS = [[1, 5, 9, 33, 70, 100], [3, 4, 200], list(range(10, 60)), [7] * 13]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, logprobs=0)

# (architecture, config overrides): Qwen2 with one KV head replicates it on both ranks;
# Mistral with a sliding window shorter than the prompts.
MODELS = {
    "llama": ("LlamaForCausalLM", {"num_hidden_layers": 4}),
    "mistral": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2ForCausalLM", {"num_key_value_heads": 1}),
    # Fused qkv / gate_up checkpoint tensors, each rank taking its rows of every part.
    "phi3": ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.75}}),
    # Experts' and shared expert's columns split over the ranks; layer 1 dense.
    "qwen2_moe": ("Qwen2MoeForCausalLM", {**MOE_SIZES["Qwen2MoeForCausalLM"], "mlp_only_layers": [1]}),
}
# (model, tensor, pipeline, data parallel sizes)
# The default run keeps each kind of split once (tp, pp, dp; phi3's fused projections; the experts
# split); the rest run with make test-slow (four ranks on two cores take ~45 s).
_SLOW_LAYOUTS = {("llama", 2, 2, 1), ("mistral", 2, 1, 1), ("qwen2", 2, 1, 1), ("qwen2_moe", 1, 2, 1)}
LAYOUTS = [("llama", 2, 1, 1), ("llama", 1, 2, 1), ("llama", 2, 2, 1), ("llama", 1, 1, 2), ("mistral", 2, 1, 1),
           ("qwen2", 2, 1, 1), ("phi3", 2, 1, 1), ("qwen2_moe", 2, 1, 1), ("qwen2_moe", 1, 2, 1)]
LAYOUT_PARAMS = [pytest.param(*layout, id="{}-tp{}-pp{}-dp{}".format(*layout),
                              marks=[pytest.mark.slow] if layout in _SLOW_LAYOUTS else [])
                 for layout in LAYOUTS]


def run(model_dir, tp: int, pp: int, dp: int = 1):
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", block_size=4,
              num_gpu_blocks_override=128, enforce_eager=True, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, data_parallel_size=dp)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
        seeded = llm.generate(prompts, SEEDED, use_tqdm=False)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return ([o.outputs[0].token_ids for o in greedy],
            [o.outputs[0].token_ids for o in seeded],
            [[entry.logprob for entry in o.outputs[0].logprobs] for o in seeded])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(name) -> (model directory, one worker's outputs), each built on first use."""
    built = {}

    def get(name: str):
        if name not in built:
            architecture, overrides = MODELS[name]
            directory = tmp_path_factory.mktemp(name)
            build_tiny_hf_model(architecture, directory, **overrides)
            built[name] = (directory, run(directory, 1, 1))
        return built[name]
    return get


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for seq_a, seq_b in zip(a, b) for x, y in zip(seq_a, seq_b)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("name, tp, pp, dp", LAYOUT_PARAMS)
def test_group_matches_one_worker(models, name, tp, pp, dp):
    directory, (greedy_ref, seeded_ref, logprobs_ref) = models(name)
    greedy, seeded, logprobs = run(directory, tp, pp, dp)
    assert token_agreement(greedy, greedy_ref) >= 0.99
    assert seeded == seeded_ref  # the same seeded draws from (nearly) the same logits
    for got, want in zip(logprobs, logprobs_ref):
        assert got == pytest.approx(want, abs=1e-3)


def test_bad_group_sizes_are_refused_before_any_rank_starts(models):
    directory, _ = models("qwen2")  # 4 query heads, 1 KV head: 3 ranks cannot share them
    from common.errors import ConfigError
    with pytest.raises(ConfigError, match="tensor_parallel_size 3"):
        LLM(model=str(directory), skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=3,
            enforce_eager=True, num_gpu_blocks_override=16)


def test_replicas_get_shared_prefixes_together_and_equal_shares():
    from pagedserve.offline.data_parallel import assign_replicas
    shared = list(range(100, 200))
    prompts = [shared + [i] for i in range(3)] + [[i] * 50 for i in range(1, 7)]
    shares = assign_replicas(prompts, 2)
    assert sorted(i for share in shares for i in share) == list(range(9))
    holders = {r for r, share in enumerate(shares) for i in share if i < 3}
    assert len(holders) == 1  # every prompt with the shared 100-token prefix on one replica
    loads = [sum(len(prompts[i]) for i in share) for share in shares]
    assert max(loads) - min(loads) <= 50  # 303 tokens against 300
