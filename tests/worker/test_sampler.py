"""Sampler: greedy, filters (exact kept sets), seeds, and the sampled distribution."""
from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from worker import random_race
from worker.kernels import cpu_extension, cpu_ops
from worker.random_race import apply_min_p, apply_top_k_top_p, top_k_top_p_sorted
from worker.sampler import Sampler, SamplingMetadata, step_seed


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def race_path(request, monkeypatch):
    """Every test runs on both random-sampling paths: the C++ kernel and PyTorch."""
    if request.param == "kernel" and not cpu_extension.expected():
        pytest.skip("no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0")
    if request.param == "torch":
        monkeypatch.setattr(random_race.cpu_ops, "load", lambda: None)
    return request.param


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def sample(logits: torch.Tensor, params: list[SamplingParams], *, seed: int = 0,
           num_output_tokens: list[int] | None = None) -> list[int]:
    meta = SamplingMetadata.build(params, num_output_tokens)
    return Sampler(seed)(logits, meta).tolist()


def draw_many(row_logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one distribution, as one batch of n rows."""
    logits = row_logits.unsqueeze(0).expand(n, -1).contiguous()
    return Sampler(seed)(logits, SamplingMetadata.build([params] * n))


def test_all_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(7, 1000)
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 7)
    assert meta.all_greedy and meta.temperature is None
    assert torch.equal(Sampler()(logits, meta), logits.argmax(dim=-1))


def test_plain_argmax_only_without_adjustments_logprobs_or_random_rows():
    """The runner skips the float32 copy of the logits only when sampling is a bare argmax."""
    greedy = SamplingParams(temperature=0.0)
    assert SamplingMetadata.build([greedy] * 3).plain_argmax
    assert not SamplingMetadata.build([greedy, SamplingParams(temperature=0.8)]).plain_argmax
    assert not SamplingMetadata.build([greedy, SamplingParams(temperature=0.0, logprobs=2)]).plain_argmax
    penalized = SamplingMetadata.build([SamplingParams(temperature=0.0, repetition_penalty=1.3)],
                                       token_ids=[[1, 2, 3]], num_prompt_tokens=[2])
    assert not penalized.plain_argmax
    # bfloat16 logits widen to float32 exactly, so the argmax (ties included) is the same
    logits = torch.randn(64, 4096).bfloat16()
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie: both pick the first index
    meta = SamplingMetadata.build([greedy] * 64)
    assert torch.equal(Sampler()(logits, meta), Sampler()(logits.float(), meta))


def test_greedy_rows_in_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_p=0.9) for i in range(6)]
    meta = SamplingMetadata.build(params)
    assert meta.random_rows.tolist() == [1, 3, 5]
    ids = Sampler()(logits, meta)
    assert ids[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()


def test_top_k_one_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(64, 300)
    ids = sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 64, seed=5)
    assert ids == logits.argmax(dim=-1).tolist()


def test_filters_skipped_when_unused():
    meta = SamplingMetadata.build([SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)])
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    meta = SamplingMetadata.build([SamplingParams(top_k=-1), SamplingParams(top_k=5)])
    assert meta.top_k.tolist() == [0, 5] and meta.top_p is None


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().squeeze(1).tolist()


@pytest.mark.parametrize("top_p, expected", [
    (0.35, [0]),  # the top token alone reaches 0.35
    (0.6, [0, 1]),  # 0.5 is short of 0.6; 0.5 + 0.25 reaches it
    (0.85, [0, 1, 2]),
    (0.95, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, expected):
    logits = log_probs(0.5, 0.25, 0.15, 0.1)  # no ties: the kept prefix is unambiguous
    out = apply_top_k_top_p(logits.unsqueeze(0), None, torch.tensor([top_p]))[0]
    assert kept(out) == expected
    assert torch.equal(out[expected], logits[expected])


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    """1e-46 passes validation (it is > 0) but is 0 in float32: the top token still stays."""
    torch.manual_seed(3)
    logits = torch.randn(8, 1000)
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-46)] * 8) == logits.argmax(dim=-1).tolist()
    out = top_k_top_p_sorted(logits, torch.full((8,), 1000), torch.zeros(8))
    assert torch.equal(out.argmax(dim=-1), logits.argmax(dim=-1)) and torch.isfinite(out).sum().item() == 8


def test_top_p_is_applied_after_top_k_renormalization():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # After top-k=3 the distribution is 4/9, 3/9, 2/9: mass before token 2 is 7/9 > 0.75.
    out = apply_top_k_top_p(logits.unsqueeze(0), torch.tensor([3]), torch.tensor([0.75]))[0]
    assert kept(out) == [0, 1]
    # Without top-k, mass before token 2 is 0.7 < 0.75, so it stays.
    out = apply_top_k_top_p(logits.unsqueeze(0), None, torch.tensor([0.75]))[0]
    assert kept(out) == [0, 1, 2]


def test_top_k_per_row_and_untouched_rows():
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    out = apply_top_k_top_p(logits, torch.tensor([5, 0, 17]), None)
    for row, k in enumerate([5, 50, 17]):
        assert sorted(kept(out[row])) == sorted(logits[row].topk(k).indices.tolist())
    assert torch.equal(out[1], logits[1])


def test_min_p_threshold_relative_to_top_probability():
    logits = log_probs(0.5, 0.25, 0.15, 0.1).unsqueeze(0).repeat(3, 1)
    out = apply_min_p(logits, torch.tensor([0.4, 0.0, 0.25]))
    assert kept(out[0]) == [0, 1]  # threshold 0.2
    assert kept(out[1]) == [0, 1, 2, 3]  # disabled
    assert kept(out[2]) == [0, 1, 2]  # threshold 0.125


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_p=0.6), {0, 1}),
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(min_p=0.6), {0, 1}),  # threshold 0.24
    (SamplingParams(min_p=0.4), {0, 1, 2}),  # threshold 0.16
    (SamplingParams(top_k=3, top_p=0.75, temperature=1.0), {0, 1}),
    (SamplingParams(temperature=2.0, top_p=0.5), {0, 1}),  # flatter: 0.5 needs two tokens
])
def test_masked_tokens_never_sampled(params, allowed):
    logits = log_probs(0.4, 0.3, 0.2, 0.06, 0.04)
    draws = draw_many(logits, params, 4000, seed=11)
    assert set(draws.tolist()) == allowed


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9999th percentile of chi-square with 4 degrees of freedom is ~33.4; the
# seeds are fixed, so this is a deterministic check with a wide margin.
CHI2_LIMIT_DF4 = 33.4


def test_sampled_distribution_matches_probabilities():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    draws = draw_many(probs.log(), SamplingParams(), 20000, seed=123)
    counts = torch.bincount(draws, minlength=5).float()
    assert chi_square(counts, probs) < CHI2_LIMIT_DF4


def test_temperature_scaling_changes_distribution():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    for temperature in (0.5, 2.0):
        draws = draw_many(probs.log(), SamplingParams(temperature=temperature), 20000, seed=7)
        counts = torch.bincount(draws, minlength=5).float()
        scaled = (probs.log() / temperature).softmax(dim=0)
        assert chi_square(counts, scaled) < CHI2_LIMIT_DF4
        # ... and is far from the unscaled distribution.
        assert chi_square(counts, probs) > 10 * CHI2_LIMIT_DF4


def test_seeded_rows_follow_the_distribution():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    n = 5000
    params = [SamplingParams(seed=s) for s in range(n)]
    ids = sample(probs.log().unsqueeze(0).expand(n, -1).contiguous(), params)
    counts = torch.bincount(torch.tensor(ids), minlength=5).float()
    assert chi_square(counts, probs) < CHI2_LIMIT_DF4


def seeded_sequence(target: SamplingParams, logits_row: torch.Tensor, batch_of_others: int,
                    position: int, steps: int = 30, engine_seed: int = 0) -> list[int]:
    """The target request's tokens over `steps` steps, sharing each batch with
    `batch_of_others` other requests (mixed greedy / seeded / unseeded)."""
    torch.manual_seed(batch_of_others)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(seed=999, top_k=7), SamplingParams(min_p=0.1)]
    sampler = Sampler(engine_seed)
    out = []
    for step in range(steps):
        params = [others[i % len(others)] for i in range(batch_of_others)]
        params.insert(position, target)
        logits = torch.randn(len(params), logits_row.shape[0])
        logits[position] = logits_row
        meta = SamplingMetadata.build(params, [step] * len(params))
        out.append(sampler(logits, meta)[position].item())
    return out


def test_same_seed_same_sequence_regardless_of_batch():
    torch.manual_seed(0)
    row = torch.randn(200) * 0.5  # flat enough that sequences vary a lot
    target = SamplingParams(seed=42, temperature=0.9, top_p=0.95)
    alone = seeded_sequence(target, row, batch_of_others=0, position=0)
    assert len(set(alone)) > 10
    assert seeded_sequence(target, row, batch_of_others=5, position=3) == alone
    assert seeded_sequence(target, row, batch_of_others=12, position=12, engine_seed=77) == alone


def test_different_seeds_differ():
    torch.manual_seed(0)
    row = torch.randn(200) * 0.5
    a = seeded_sequence(SamplingParams(seed=1), row, 0, 0)
    b = seeded_sequence(SamplingParams(seed=2), row, 0, 0)
    assert sum(x != y for x, y in zip(a, b)) > len(a) // 2


def test_unseeded_rows_reproducible_per_engine_seed():
    torch.manual_seed(4)
    logits = torch.randn(16, 100)
    params = [SamplingParams()] * 16
    assert sample(logits, params, seed=3) == sample(logits, params, seed=3)
    assert sample(logits, params, seed=3) != sample(logits, params, seed=4)


def test_step_seed_spreads_indices_and_handles_negative_seeds():
    seeds = {step_seed(s, k) for s in (-2, 0, 1, 2**63) for k in range(100)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**64 for s in seeds)
    assert step_seed(-1, 5) == step_seed(2**64 - 1, 5)  # the same 64-bit seed


def test_row_count_mismatch_rejected():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 4), SamplingMetadata.build([SamplingParams()]))


def test_large_vocab_random_batch_is_valid_token():
    torch.manual_seed(5)
    logits = torch.randn(8, 49152)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s)
              for t, k, p, m, s in [(1.0, 50, 0.9, 0.0, 1), (0.7, 0, 1.0, 0.05, None),
                                    (0.0, 0, 1.0, 0.0, None), (1.2, 20, 1.0, 0.0, None),
                                    (1.0, 0, 0.5, 0.0, 3), (0.3, 0, 1.0, 0.0, None),
                                    (1.0, 1, 1.0, 0.0, None), (1.0, 0, 1.0, 0.0, 4)]]
    ids = sample(logits, params)
    assert ids[2] == logits[2].argmax().item() and ids[6] == logits[6].argmax().item()
    assert ids[0] in logits[0].topk(50).indices.tolist()
    assert ids[3] in logits[3].topk(20).indices.tolist()
    assert all(0 <= i < 49152 for i in ids)
