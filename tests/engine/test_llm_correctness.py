"""Issue acceptance: the offline engine's greedy output equals transformers' token for token,
whatever the chunking, prefix-cache hits or preemptions."""
from __future__ import annotations

import random

import pytest

from common.sampling_params import SamplingParams
from tiny_models import build_tiny_hf_model, hf_greedy
from pagedserve.offline.llm import LLM

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def random_prompts(count: int, vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leaked_blocks(llm: LLM) -> None:
    stats = llm.scheduler.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"


@pytest.mark.parametrize("architecture,overrides", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                          "tie_word_embeddings": True}),
    ("MistralForCausalLM", {"sliding_window": 8}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", {}),
    # Both layer kinds, a window of 6, both soft-caps (attention logits on Gemma 2 only, as transformers).
    ("Gemma2ForCausalLM", {"sliding_window": 6, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0,
                           "query_pre_attn_scalar": 24, "num_hidden_layers": 3}),
    ("Gemma3ForCausalLM", {"sliding_window": 6, "final_logit_softcapping": 8.0, "query_pre_attn_scalar": 24,
                           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                           "num_hidden_layers": 3, "rope_parameters": {
                               "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}),
])
def test_greedy_matches_transformers_with_chunked_prefill(tmp_path, architecture, overrides):
    hf_model = build_tiny_hf_model(architecture, tmp_path / "model", **overrides)
    prompts = random_prompts(8, hf_model.config.vocab_size, [3, 17, 40, 9, 64, 1, 25, 33])
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    # A 24-token budget forces long prompts through several prefill chunks, mixed with decodes.
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", block_size=4, max_num_batched_tokens=24,
              num_gpu_blocks_override=256, skip_tokenizer_init=True)
    assert generate_ids(llm, prompts) == expected
    assert_no_leaked_blocks(llm)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_hf_model("LlamaForCausalLM", directory), directory


def recorded_plans(llm: LLM) -> list:
    """Record every StepPlan the worker executes."""
    plans = []
    execute = llm.worker.execute

    def record(plan):
        plans.append(plan)
        return execute(plan)
    llm.worker.execute = record
    return plans


def test_prefix_cache_reuses_exactly_the_shared_blocks(tiny_llama):
    hf_model, directory = tiny_llama
    shared = random_prompts(1, 256, [12], seed=1)[0]  # 3 full blocks of 4 tokens
    first, second = shared + [5, 6, 7], shared + [9, 10]
    llm = LLM(model=str(directory), dtype="float32", block_size=4, num_gpu_blocks_override=64,
              skip_tokenizer_init=True)
    plans = recorded_plans(llm)
    out_first = generate_ids(llm, [first])
    first_blocks = next(r.block_ids for p in plans for r in p.new_requests)
    plans.clear()
    hits_before = llm.scheduler.stats().prefix_cache_hits
    result = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    new_request = next(r for p in plans for r in p.new_requests)
    assert new_request.block_ids[:3] == first_blocks[:3]
    assert new_request.num_computed_tokens == 12
    assert result.num_cached_tokens == 12
    assert llm.scheduler.stats().prefix_cache_hits - hits_before == 12
    assert_no_leaked_blocks(llm)

    uncached = LLM(model=str(directory), dtype="float32", block_size=4, num_gpu_blocks_override=64,
                   enable_prefix_caching=False, skip_tokenizer_init=True)
    assert generate_ids(uncached, [first, second]) == [out_first[0], result.outputs[0].token_ids]
    assert [out_first[0], result.outputs[0].token_ids] == [hf_greedy(hf_model, p, NEW_TOKENS) for p in (first, second)]


def test_preemption_keeps_outputs_identical(tiny_llama, caplog):
    _, directory = tiny_llama
    prompts = random_prompts(8, 256, [10, 20, 6, 15], seed=2)
    roomy = LLM(model=str(directory), dtype="float32", block_size=4, num_gpu_blocks_override=512,
                skip_tokenizer_init=True)
    expected = generate_ids(roomy, prompts)
    assert roomy.scheduler.stats().num_preemptions == 0
    # 24 usable blocks (96 token slots) for 8 requests of up to 52 tokens each.
    tight = LLM(model=str(directory), dtype="float32", block_size=4, num_gpu_blocks_override=25,
                max_model_len=64, skip_tokenizer_init=True)
    with caplog.at_level("WARNING"):
        assert generate_ids(tight, prompts) == expected
    assert tight.scheduler.stats().num_preemptions > 0
    assert any("preempt" in r.getMessage().lower() for r in caplog.records)
    assert_no_leaked_blocks(tight)


def test_prompt_longer_than_max_model_len_is_rejected(tiny_llama):
    _, directory = tiny_llama
    llm = LLM(model=str(directory), dtype="float32", max_model_len=32, num_gpu_blocks_override=64,
              skip_tokenizer_init=True)
    from common.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="40.*32|32.*40"):
        llm.generate([{"prompt_token_ids": list(range(3, 43))}], GREEDY, use_tqdm=False)
    assert_no_leaked_blocks(llm)


def test_out_of_vocabulary_prompt_token_is_rejected_before_any_work(tiny_llama):
    _, directory = tiny_llama
    llm = LLM(model=str(directory), dtype="float32", num_gpu_blocks_override=64, enforce_eager=True,
              skip_tokenizer_init=True)
    from common.errors import InvalidRequestError
    for bad in (256, -1):  # the tiny vocabulary has 256 tokens
        with pytest.raises(InvalidRequestError, match=f"Token id {bad} is out of vocabulary"):
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, bad, 7]}], GREEDY, use_tqdm=False)
        assert not llm.scheduler.has_unfinished_requests()
        assert not llm.worker.input_batch.requests  # nothing reached the worker
    assert_no_leaked_blocks(llm)
