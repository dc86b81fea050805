"""The offline engine with the full sampling parameters on a tiny random Llama:
logprobs (sampled and prompt, across chunked prefill) equal transformers'
log-softmax, penalties steer greedy exactly like transformers' generate, n /
best_of / seeds behave, and the prompt of n samples is computed once."""
from __future__ import annotations

import random

import pytest
import torch

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from tiny_models import tiny_llama_engine

BLOCK = 4
EOS = 2  # LlamaConfig's default eos_token_id


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # A small token budget chunks every prompt below over several steps.
    return tiny_llama_engine(tmp_path_factory.mktemp("tiny-llama"), block_size=BLOCK, num_gpu_blocks_override=200,
                             max_num_batched_tokens=8)


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(count)]


def reference_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row p is log p(token p + 1 | tokens ..p)."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def assert_entry_matches(entry, reference_row: torch.Tensor, token_id: int, k: int) -> None:
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(reference_row[token_id].item(), abs=1e-4)
    assert entry.rank == int((reference_row > reference_row[token_id] + 1e-5).sum()) + 1
    top = reference_row.topk(k)
    assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    # Ids may only differ where logprobs tie.
    assert [round(reference_row[t].item(), 3) for t in entry.top_token_ids] == pytest.approx(
        [round(v, 3) for v in top.values.tolist()], abs=2e-3)


def test_logprobs_and_prompt_logprobs_equal_transformers(tiny):
    hf_model, llm = tiny
    batch = prompts(3, 13) + prompts(1, 1, seed=1)  # chunked prompts, and a one-token prompt
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for prompt, out in zip(batch, outputs):
        completion = out.outputs[0]
        sequence = prompt + completion.token_ids
        reference = reference_logprobs(hf_model, sequence)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert_entry_matches(entry, reference[position - 1], prompt[position], 4)
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for i, entry in enumerate(completion.logprobs):
            assert_entry_matches(entry, reference[len(prompt) - 1 + i], completion.token_ids[i], 5)
        assert completion.cumulative_logprob == pytest.approx(sum(e.logprob for e in completion.logprobs))


def test_repetition_penalty_steers_greedy_like_transformers_generate(tiny):
    hf_model, llm = tiny
    prompt = prompts(1, 10, seed=3)[0]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                     repetition_penalty=1.8, attention_mask=torch.ones(1, 10, dtype=torch.long),
                                     pad_token_id=0)[0, 10:].tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, repetition_penalty=1.8, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids != expected  # the penalty did change something


def test_min_tokens_keeps_eos_from_being_sampled(tiny):
    _, llm = tiny
    forced_eos = SamplingParams(temperature=0, logit_bias={EOS: 100.0}, max_tokens=20)
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], forced_eos, use_tqdm=False)
    assert out.outputs[0].token_ids == [EOS] and out.outputs[0].finish_reason == "stop"
    forced_eos.min_tokens = 5
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], forced_eos, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 6 and EOS not in tokens[:5] and tokens[5] == EOS
    assert out.outputs[0].finish_reason == "stop"


def test_n_samples_fork_after_one_prefill_with_their_own_seed_streams(tiny):
    _, llm = tiny
    prompt = prompts(1, 4 * BLOCK + 1, seed=5)[0]  # 4 full blocks, then the last token
    before = llm.scheduler.stats()
    params = SamplingParams(n=4, temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    after = llm.scheduler.stats()
    texts = [tuple(c.token_ids) for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and len(set(texts)) == 4
    # The prompt was computed once: the 3 forks reuse all 4 full prompt blocks.
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4 * len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * 4 * BLOCK
    assert after.num_prompt_tokens - before.num_prompt_tokens == len(prompt)
    # Sample i runs with seed + i: the same tokens as a lone request with that seed.
    for i in (0, 3):
        alone = SamplingParams(temperature=1.0, seed=21 + i, max_tokens=8, ignore_eos=True)
        [single] = llm.generate([{"prompt_token_ids": prompt}], alone, use_tqdm=False)
        assert tuple(single.outputs[0].token_ids) == texts[i]
    [again] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == texts
    stats = llm.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_best_of_returns_the_samples_with_the_best_cumulative_logprob(tiny):
    _, llm = tiny
    prompt = prompts(1, 9, seed=6)[0]
    every = SamplingParams(n=5, temperature=1.2, seed=4, max_tokens=6, ignore_eos=True, logprobs=0)
    [all_samples] = llm.generate([{"prompt_token_ids": prompt}], every, use_tqdm=False)
    ranked = sorted(all_samples.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    [best] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        n=2, best_of=5, temperature=1.2, seed=4, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert all(c.logprobs is None for c in best.outputs)  # not asked for: only used for ranking


def test_invalid_params_are_rejected_before_any_work(tiny):
    _, llm = tiny
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)
    assert error.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(n=3, best_of=2), use_tqdm=False)
    assert error.value.param == "best_of"
    assert not llm.scheduler.has_unfinished_requests()


def test_stop_reason_names_the_stop_token_without_a_tokenizer(tiny):
    _, llm = tiny
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    [plain] = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    stop_id = plain.outputs[0].token_ids[2]
    stop = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], stop, use_tqdm=False)
    # As vLLM: the stop token is the last output token and the stop_reason.
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids[:3]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)
    eos = SamplingParams(temperature=0, max_tokens=10, logit_bias={EOS: 100.0})
    [out] = llm.generate([{"prompt_token_ids": prompt}], eos, use_tqdm=False)
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ([EOS], "stop", None)
