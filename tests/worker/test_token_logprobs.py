"""Sampled tokens' logprobs: the CPU kernel against log_softmax, gather and topk."""
from __future__ import annotations

import pytest
import torch

from worker.kernels import cpu_extension, cpu_ops
from worker.logprobs import KERNEL_MAX_TOP, select_logprobs, token_logprobs

pytestmark = pytest.mark.skipif(not cpu_extension.expected(), reason="no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 16, 1000, 49152])
def test_kernel_equals_log_softmax_topk(dtype, vocab):
    torch.manual_seed(vocab)
    rows = 24
    logits = (torch.randn(rows, vocab) * torch.linspace(0.1, 12, rows).unsqueeze(1)).to(dtype)
    chosen = torch.randint(0, vocab, (rows,))
    num_top = [min(k, vocab) for k in [0, 1, 5, 20, KERNEL_MAX_TOP] * 4 + [3, 0, 2, 7]]
    ours = token_logprobs(logits, chosen, num_top)
    reference = select_logprobs(logits.float().log_softmax(dim=-1), chosen, num_top)
    for row, (got, want) in enumerate(zip(ours, reference)):
        assert got.token_id == want.token_id and got.rank == want.rank
        assert got.logprob == pytest.approx(want.logprob, abs=2e-5, rel=1e-6)
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=2e-5, rel=1e-6)
        if dtype == torch.float32:  # bf16 rows hold ties, which topk orders as it likes
            assert got.top_token_ids == want.top_token_ids
        values = logits[row].float()
        assert sorted(values[got.top_token_ids].tolist(), reverse=True) == values[got.top_token_ids].tolist()
        assert sorted(values[got.top_token_ids].tolist()) == sorted(values[want.top_token_ids].tolist())


def test_ties_share_the_better_rank_and_list_lower_ids_first():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.5]])
    [entry] = token_logprobs(logits, torch.tensor([4]), [4])
    assert entry.rank == 1 and entry.top_token_ids == [1, 3, 4, 2]
    [entry] = token_logprobs(logits, torch.tensor([2]), [0])
    assert entry.rank == 4 and entry.top_token_ids == []
