"""Final logit soft-capping (Gemma) around every lm_head strategy this CPU can run."""
from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from worker.lm_head import choose_lm_head
from worker.lm_head.final_softcap import SoftcappedLmHead, soft_cap_logits, with_final_softcap
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.sampler import Sampler, SamplingMetadata


def problem(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 64, generator=g).to(dtype)
    weight = torch.randn(300, 64, generator=g).to(dtype)
    return hidden, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_capped_in_the_model_dtype(dtype: torch.dtype) -> None:
    hidden, weight = problem(dtype)
    inner = choose_lm_head(weight)  # whichever strategy this CPU picks for the dtype
    head = with_final_softcap(inner, 3.0)
    plain = torch.nn.functional.linear(hidden, weight)
    expected = (torch.tanh(plain / 3.0) * 3.0)  # transformers: in the model dtype
    capped = head.logits(hidden)
    assert capped.dtype == torch.float32 and head.logits(hidden, upcast=False).dtype == dtype
    torch.testing.assert_close(capped, expected.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    assert capped.abs().max() <= 3.0 < plain.abs().max()  # the cap changes these logits
    assert head.greedy(hidden) is None  # greedy rows take the capped logits' argmax
    assert head.vocab_size == 300 and "soft-capped at 3" in head.describe()


def test_greedy_is_the_argmax_of_the_capped_logits() -> None:
    """Capping saturates: tokens 4 and 9 both cap to 3.0 though 9's raw logit is larger. The
    greedy token is the first maximum of the capped logits handed out, as transformers picks."""
    weight = torch.zeros(16, 4)
    weight[4, 0], weight[9, 0] = 100.0, 120.0
    hidden = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    head = with_final_softcap(PlainLogitsLmHead(weight), 3.0)
    logits = head.logits(hidden)
    assert logits[0, 4] == logits[0, 9] == 3.0
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)])
    assert Sampler(0).sample(logits, meta, head, hidden).token_ids.tolist() == [4]


def test_no_cap_is_the_head_itself_and_bad_caps_are_refused() -> None:
    head = PlainLogitsLmHead(torch.zeros(4, 2))
    assert with_final_softcap(head, None) is head and with_final_softcap(head, 0.0) is head
    with pytest.raises(ValueError, match="final_logit_softcapping must be positive"):
        SoftcappedLmHead(head, -1.0)


def test_soft_cap_formula() -> None:
    x = torch.tensor([-100.0, -1.0, 0.0, 2.0, 100.0])
    torch.testing.assert_close(soft_cap_logits(x, 5.0), 5.0 * torch.tanh(x / 5.0))
