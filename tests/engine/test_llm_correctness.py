"""Issue acceptance: the offline engine's greedy output equals transformers' token for token,
whatever the chunking, prefix-cache hits or preemptions."""
from __future__ import annotations

import random

import pytest
import torch

from common.sampling_params import SamplingParams
from tiny_models import MOE_SIZES, build_tiny_hf_model, hf_greedy
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


PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "factor": 4.0,
                 "short_factor": [1.0 + 0.2 * i for i in range(6)], "long_factor": [2.0 + 3.0 * i for i in range(6)]}


@pytest.mark.parametrize("architecture,overrides", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                          "tie_word_embeddings": True}),
    ("MistralForCausalLM", {"sliding_window": 8}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", {}),
    # Phi-4-mini's partial rotary with LongRoPE (short factors: max_model_len 128 = the original length).
    ("Phi3ForCausalLM", {"rope_parameters": PHI3_LONGROPE, "max_position_embeddings": 128,
                         "original_max_position_embeddings": 128, "sliding_window": 16}),
    ("MixtralForCausalLM", MOE_SIZES["MixtralForCausalLM"]),
    ("Qwen2MoeForCausalLM", {**MOE_SIZES["Qwen2MoeForCausalLM"], "mlp_only_layers": [1]}),
    ("Qwen3MoeForCausalLM", {**MOE_SIZES["Qwen3MoeForCausalLM"], "decoder_sparse_step": 2, "num_hidden_layers": 3}),
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
    """Every architecture: greedy tokens equal transformers' and their logprobs agree within 1e-3,
    through chunked prefills mixed with decodes, prefix-cache hits and preemptions."""
    hf_model = build_tiny_hf_model(architecture, tmp_path / "model", **overrides)
    prompts = random_prompts(8, hf_model.config.vocab_size, [3, 17, 40, 9, 64, 1, 25, 33])
    prompts[6] = prompts[2][:20] + prompts[6][:5]  # shares five blocks with prompt 2
    prompts[7] = prompts[2][:22] + prompts[7][:9]  # and five blocks and two tokens (a partial hit)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    # A 24-token budget forces long prompts through several prefill chunks, mixed with decodes;
    # 39 blocks (156 token slots) for up to 96 tokens a sequence force preemptions. Where every
    # layer has a window, sequences give their old blocks back: 15 blocks then.
    every_layer_windowed = architecture in ("MistralForCausalLM", "Phi3ForCausalLM")
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", block_size=4, max_num_batched_tokens=24,
              num_gpu_blocks_override=16 if every_layer_windowed else 40, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                  use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    stats = llm.scheduler.stats()
    assert stats.num_preemptions > 0
    # (15 blocks churn too fast for a hit to survive; test_kv_cache_manager checks windowed hits.)
    assert stats.prefix_cache_hits > 0 or every_layer_windowed
    with torch.no_grad():
        for prompt, tokens, output in zip(prompts, expected, outputs):
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
            reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            assert [step.token_id for step in output.logprobs] == tokens
            ours = torch.tensor([step.logprob for step in output.logprobs])
            torch.testing.assert_close(ours, reference, atol=1e-3, rtol=0)
    assert_no_leaked_blocks(llm)
    if architecture in MOE_SIZES:  # the experts' dispatch compiles as one opaque op, not eager fallback
        from worker.compiled_forward import inductor_available
        assert llm.worker.forward.compiled == inductor_available()


def test_phi3_longrope_factors_follow_max_model_len(tmp_path):
    """original_max_position_embeddings 24 of 512. With max_model_len 24 the short factors: exact for
    sequences within it; by default (512) the long ones: exact for prompts longer than 24, which
    transformers rotates wholly with the long factors (it recomputes a sequence that crosses 24)."""
    rope = {key: value for key, value in PHI3_LONGROPE.items() if key != "factor"}
    hf_model = build_tiny_hf_model("Phi3ForCausalLM", tmp_path / "model", rope_parameters=rope,
                                   original_max_position_embeddings=24)
    settings = dict(model=str(tmp_path / "model"), dtype="float32", block_size=4, max_num_batched_tokens=24,
                    num_gpu_blocks_override=128, skip_tokenizer_init=True)
    for max_model_len, lengths, new_tokens in ((24, [3, 9, 14, 6], 8), (None, [25, 40, 31, 57], 16)):
        prompts = random_prompts(4, hf_model.config.vocab_size, lengths, seed=3)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        llm = LLM(max_model_len=max_model_len, **settings)
        assert llm.worker.model.rotary.long_factors == (max_model_len is None)
        assert generate_ids(llm, prompts, params) == [hf_greedy(hf_model, p, new_tokens) for p in prompts]


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


def test_partial_prefix_hit_copies_kv_that_computing_would_give(tiny_llama):
    """A prompt sharing 3 whole blocks and 2 tokens of the next with a cached one: the 2 tokens'
    KV is copied from the cached block (StepPlan.kv_copies), and the logprobs are the uncached run's."""
    hf_model, directory = tiny_llama
    shared = random_prompts(1, 256, [14], seed=4)[0]  # 3 full blocks of 4 tokens, then 2 more
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    settings = dict(model=str(directory), dtype="float32", block_size=4, num_gpu_blocks_override=64,
                    skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    llm = LLM(**settings)
    plans = recorded_plans(llm)
    llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    first_blocks = next(r.block_ids for p in plans for r in p.new_requests)
    plans.clear()
    cached = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    new_request = next(r for p in plans for r in p.new_requests)
    assert new_request.num_computed_tokens == 14 and cached.num_cached_tokens == 14
    assert [c for p in plans for c in p.kv_copies] == [(first_blocks[3], new_request.block_ids[3], 2)]
    assert_no_leaked_blocks(llm)

    uncached = LLM(enable_prefix_caching=False, **settings)
    reference = uncached.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0].outputs[0]
    assert cached.outputs[0].token_ids == reference.token_ids == hf_greedy(hf_model, second, NEW_TOKENS)
    torch.testing.assert_close(torch.tensor([s.logprob for s in cached.outputs[0].logprobs]),
                               torch.tensor([s.logprob for s in reference.logprobs]), atol=1e-5, rtol=0)


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


def test_sliding_window_model_runs_sequences_longer_than_its_kv_cache(tmp_path):
    """Every Mistral layer sees 8 positions: blocks behind the window go back to the pool, so
    72-token sequences run in 8 blocks of 4 tokens, token for token as transformers."""
    hf_model = build_tiny_hf_model("MistralForCausalLM", tmp_path / "model", sliding_window=8)
    prompts = random_prompts(3, hf_model.config.vocab_size, [40, 37, 45], seed=3)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=9, skip_tokenizer_init=True)
    assert llm.scheduler.max_model_len == 512  # not capped by the 32 token slots
    assert generate_ids(llm, prompts) == expected
    assert_no_leaked_blocks(llm)
    # Samples of one prompt share its leading blocks, freed ones included.
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs[0].outputs] == [NEW_TOKENS] * 3
    assert_no_leaked_blocks(llm)
