"""With the near-tie re-score on, greedy near-ties of bfloat16 logits are settled by float32
re-scoring (the option itself, on and off through the engine: test_lm_head_strategies)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from common.sampling_params import SamplingParams
from worker.kernels import cpu_extension, cpu_ops
from worker.lm_head.near_tie_rescore import NearTieRescore, NearTopScan, near_top_scan, refine_greedy, rounding_step
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.sampler import Sampler, SamplingMetadata


def test_rounding_step_is_the_bfloat16_spacing():
    values = torch.tensor([1.0, 20.0, -20.0, 0.3])
    assert rounding_step(values, torch.bfloat16).tolist() == [2 ** -7, 2 ** -3, 2 ** -3, 2 ** -9]
    assert rounding_step(torch.tensor([1.0]), torch.float16).item() == 2 ** -10


def near_tie_problem(rows: int = 32, vocab: int = 512, hidden_size: int = 64):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=g).bfloat16()
    weight = torch.randn(vocab, hidden_size, generator=g).bfloat16()
    # Token 7 is a copy of token 3 nudged a little: their logits differ by less than bf16 can tell.
    weight[7] = weight[3]
    weight[7, 0] = weight[3, 0] + torch.tensor(2 ** -6).bfloat16()
    weight[3] *= 4  # and make the pair the top of every row whose hidden state points their way
    weight[7] = (weight[7].float() * 4).bfloat16()
    hidden[:, :] = (hidden.float() + weight[3].float() / 8).bfloat16()
    return hidden, weight


def test_refined_pick_is_the_argmax_of_the_unrounded_logits():
    hidden, weight = near_tie_problem()
    logits = F.linear(hidden, weight)  # bfloat16, rounded
    exact = hidden.float() @ weight.float().T
    rows = torch.arange(hidden.shape[0])
    refined = refine_greedy(logits, rows, hidden, weight, torch.bfloat16)
    assert torch.equal(refined, exact.argmax(dim=-1))
    assert not torch.equal(logits.argmax(dim=-1), exact.argmax(dim=-1)), "the problem must hold rounding ties"
    # float32-held copies of the same rounded values give the same picks (mixed batches upcast)
    assert torch.equal(refine_greedy(logits.float(), rows, hidden, weight, torch.bfloat16), refined)
    # a row's pick does not depend on the other rows
    for row in (0, 5, 31):
        alone = refine_greedy(logits[row:row + 1], torch.tensor([0]), hidden[row:row + 1], weight, torch.bfloat16)
        assert alone.item() == refined[row].item()


def test_exact_ties_go_to_the_lowest_token_id():
    hidden = torch.ones(1, 4).bfloat16()
    weight = torch.zeros(6, 4).bfloat16()
    weight[2] = weight[4] = 1.0
    logits = F.linear(hidden, weight)
    assert refine_greedy(logits, torch.tensor([0]), hidden, weight, torch.bfloat16).item() == 2


def test_sampler_refines_only_unadjusted_greedy_rows():
    hidden, weight = near_tie_problem(rows=4)
    logits = F.linear(hidden, weight).float()
    exact = (hidden.float() @ weight.float().T).argmax(dim=-1)
    greedy = SamplingParams(temperature=0.0)
    params = [greedy, SamplingParams(temperature=0.0, logit_bias={11: 0.5}), SamplingParams(temperature=1.0, seed=3),
              greedy]
    meta = SamplingMetadata.build(params, [0] * 4, token_ids=[[1, 2]] * 4, num_prompt_tokens=[2] * 4)
    assert meta.unadjusted_greedy_rows() == [0, 3]
    calls = []

    class CountingRescore(NearTieRescore):
        def pick(self, l, rows, h):
            calls.append(rows.tolist())
            return super().pick(l, rows, h)

    head = PlainLogitsLmHead(weight, near_ties=CountingRescore(weight, NearTopScan(compile=False)))
    out = Sampler(seed=0).sample(logits.clone(), meta, head, hidden).token_ids
    plain = Sampler(seed=0).sample(logits.clone(), meta).token_ids
    assert torch.equal(Sampler(seed=0).sample(logits.clone(), meta, PlainLogitsLmHead(weight), hidden).token_ids,
                       plain)  # the re-score off: the argmax, no call
    assert calls == [[0, 3]]
    assert out[0] == exact[0] and out[3] == exact[3]
    assert out[1] == plain[1] and out[2] == plain[2]  # adjusted and random rows as before


def test_compiled_near_top_scan_matches_eager():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(7, 3000, generator=g) * 4).round().to(torch.bfloat16)  # many exact ties
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie at the top: the lower id wins
    scan = NearTopScan(compile=True, use_kernel=False)
    expected_ids, expected_counts = near_top_scan(logits, torch.bfloat16)
    for rows in (logits, logits[:2], logits[4:5]):  # the compiled graph, again, and one row (eager)
        ids, counts = scan(rows, torch.bfloat16)
        offset = 0 if rows is logits or rows.shape[0] == 2 else 4
        assert torch.equal(ids, expected_ids[offset:offset + rows.shape[0]])
        assert torch.equal(counts, expected_counts[offset:offset + rows.shape[0]])
    assert expected_ids[3] == 10 and expected_counts[3] >= 2
    assert torch.equal(expected_ids, logits.float().argmax(dim=-1))


@pytest.mark.skipif(not cpu_extension.expected(), reason="no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_near_top_scan_matches_eager(dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 3001, generator=g) * 4).round().to(dtype)  # many exact ties; odd width
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie at the top: the lower id wins
    logits[5, -1] = logits[5].max() + 0.01  # the maximum in the unvectorized tail
    logits[6] = float("-inf")
    logits[7] = torch.randn(3001, generator=g).to(dtype) * 1e-30  # tiny magnitudes: clamped spacing
    scan = NearTopScan(compile=False, use_kernel=True)
    for rows in (logits, logits[4:5], logits[:, :7]):
        ids, counts = scan(rows, torch.bfloat16)
        expected_ids, expected_counts = near_top_scan(rows.contiguous(), torch.bfloat16)
        assert torch.equal(ids, expected_ids) and torch.equal(counts, expected_counts)
    assert ids.dtype == counts.dtype == torch.int64


def test_all_greedy_batches_take_the_refiners_argmax():
    hidden, weight = near_tie_problem(rows=6)
    logits = F.linear(hidden, weight)
    exact = (hidden.float() @ weight.float().T).argmax(dim=-1)
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 6, [0] * 6, token_ids=[[1, 2]] * 6,
                                  num_prompt_tokens=[2] * 6)
    head = PlainLogitsLmHead(weight, near_ties=NearTieRescore(weight, NearTopScan(compile=False)))
    out = Sampler(seed=0).sample(logits, meta, head, hidden).token_ids
    assert torch.equal(out, exact)


def test_a_scan_that_fails_to_compile_runs_eagerly(caplog):
    logits = torch.randn(4, 100).to(torch.bfloat16)
    scan = NearTopScan(compile=True, use_kernel=False)

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    scan._compiled = broken
    with caplog.at_level(logging.WARNING):
        ids, counts = scan(logits, torch.bfloat16)
    assert torch.equal(ids, logits.float().argmax(dim=-1)) and bool((counts >= 1).all())
    assert "runs eagerly" in caplog.text and scan._compiled is None
