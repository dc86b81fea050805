"""Speculative decoding through the offline engine on tiny random models (float32): greedy
outputs equal plain decoding with n-gram drafts and with a draft model, for Llama and Qwen2;
seeded sampling gives the same tokens; unseeded sampling keeps the model's distribution
(chi-square against the exact one from transformers, and against plain decoding); logprobs
are the model's; preemption and heavy rejection leak no block."""
from __future__ import annotations

import random

import pytest
import torch

from common.sampling_params import SamplingParams
from pagedserve.offline.llm import LLM
from tiny_models import build_tiny_hf_model, save_perturbed

SETTINGS = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", attention_backend="torch", block_size=4,
                enforce_eager=True, seed=0, num_gpu_blocks_override=1024)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])
def models(request, tmp_path_factory):
    """(transformers model, its directory, a draft's directory: the model with its weights
    perturbed, so that it agrees with it often but not always)."""
    target = tmp_path_factory.mktemp("target")
    draft = tmp_path_factory.mktemp("draft")
    hf_model = build_tiny_hf_model(request.param, target)
    save_perturbed(build_tiny_hf_model(request.param, draft), draft, 0.08)
    return hf_model, target, draft


@pytest.fixture(scope="module")
def other_draft(models, tmp_path_factory):
    """A draft that mostly disagrees: one layer, other weights."""
    directory = tmp_path_factory.mktemp("other-draft")
    build_tiny_hf_model(type(models[0]).__name__, directory, seed=1, num_hidden_layers=1)
    return directory


def copy_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves, so that prompt lookup finds n-grams."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        part = [rng.randrange(3, 256) for _ in range(rng.randint(6, 12))]
        out.append(part + [rng.randrange(3, 256)] + part + part[:rng.randint(1, 4)])
    return out


def generate(llm: LLM, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leaked_blocks(llm: LLM) -> None:
    kv = llm.scheduler.kv_cache_manager
    assert kv.req_to_blocks == {} and kv.num_free_blocks == kv.block_pool.num_usable_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_plain_decoding(models, method):
    _, target, draft = models
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(draft),
                                           "num_speculative_tokens": 4}
    prompts = copy_prompts(6)
    # Long enough for the random models to start repeating themselves (n-grams to find).
    params = SamplingParams(temperature=0, max_tokens=64 if method == "ngram" else 24, ignore_eos=True)
    plain = tokens(generate(LLM(model=str(target), **SETTINGS), prompts, params))
    llm = LLM(model=str(target), speculative_config=spec, **SETTINGS)
    assert tokens(generate(llm, prompts, params)) == plain
    stats = llm.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(llm)


def test_draft_model_equal_to_the_model_accepts_everything(models):
    _, target, _ = models
    llm = LLM(model=str(target), speculative_config={"method": "draft_model", "model": str(target),
                                                     "num_speculative_tokens": 3}, **SETTINGS)
    generate(llm, copy_prompts(3), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stats = llm.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_seeded_sampling_gives_the_same_tokens_and_logprobs(models):
    """Each checked position samples with the noise of its output index: a seeded request
    gives the tokens it gives without speculation, penalties and filters included."""
    _, target, draft = models
    prompts = copy_prompts(4, seed=2)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.01, presence_penalty=0.4,
                             repetition_penalty=1.1, logit_bias={7: 2.0}, seed=100 + i, max_tokens=20,
                             ignore_eos=True, logprobs=3) for i in range(len(prompts))]
    plain = generate(LLM(model=str(target), **SETTINGS), prompts, params)
    llm = LLM(model=str(target), speculative_config={"method": "draft_model", "model": str(target),
                                                     "num_speculative_tokens": 3}, **SETTINGS)
    spec = generate(llm, prompts, params)
    assert tokens(spec) == tokens(plain)
    assert llm.scheduler.spec_stats.num_accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert (x.token_id, x.rank, x.top_token_ids) == (y.token_id, y.rank, y.top_token_ids)
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit of counts to expected counts (bins under 5 expected merged)."""
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum().unsqueeze(0)])
    exp = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
    obs, exp = (obs, exp) if exp[-1] >= 5 else (obs[:-1], exp[:-1])
    statistic = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic.double() / 2))


def test_sampling_keeps_the_model_distribution(models, other_draft):
    """Unseeded samples of the second output token (the first one drafts are checked for)
    against the exact marginal from transformers; the third against plain decoding's."""
    hf_model, target, _ = models
    draft = other_draft
    prompt = copy_prompts(1, seed=5)[0]
    count = 3000
    params = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)
    spec_config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
                   "disable_by_batch_size": 4096}
    runs = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": spec_config})):
        llm = LLM(model=str(target), **{**SETTINGS, "seed": 7}, **extra)
        runs[name] = torch.tensor(tokens(generate(llm, [prompt] * count, params)))
        if name == "spec":
            stats = llm.scheduler.spec_stats
            assert stats.num_drafts >= count // 2 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
            assert_no_leaked_blocks(llm)
    with torch.no_grad():
        first = (hf_model(torch.tensor([prompt])).logits[0, -1] / 0.7).softmax(-1)
        batch = torch.tensor([prompt + [t] for t in range(first.numel())])
        second = (hf_model(batch).logits[:, -1] / 0.7).softmax(-1)
    marginal = (first.unsqueeze(1) * second).sum(0).double()
    for name in ("plain", "spec"):
        observed = torch.bincount(runs[name][:, 1], minlength=marginal.numel()).double()
        assert chi_square_p(observed, marginal * count) > 1e-3, name
    # Two samples of the third token: their pooled frequencies are the expectation of each.
    third = [torch.bincount(runs[n][:, 2], minlength=marginal.numel()).double() for n in ("plain", "spec")]
    pooled = (third[0] + third[1]) / 2
    assert chi_square_p(third[1], pooled) > 1e-3


def test_preemption_and_heavy_rejection_leak_no_blocks(models, other_draft):
    _, target, _ = models
    draft = other_draft
    prompts = copy_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    tight = dict(SETTINGS, num_gpu_blocks_override=40)
    plain = tokens(generate(LLM(model=str(target), **tight), prompts, params))
    # A one-layer draft with other weights: most of its drafts are rejected.
    llm = LLM(model=str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                                     "num_speculative_tokens": 4}, **tight)
    assert tokens(generate(llm, prompts, params)) == plain
    assert llm.scheduler.num_preemptions > 0
    stats = llm.scheduler.spec_stats
    assert stats.num_draft_tokens > 2 * stats.num_accepted_tokens
    assert_no_leaked_blocks(llm)


def test_a_draft_model_with_another_vocabulary_is_refused(models, tmp_path):
    from common.errors import ConfigError
    _, target, _ = models
    build_tiny_hf_model("LlamaForCausalLM", tmp_path, vocab_size=300)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(model=str(target), speculative_config={"method": "draft_model", "model": str(tmp_path),
                                                   "num_speculative_tokens": 2}, **SETTINGS)
