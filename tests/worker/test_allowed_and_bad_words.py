"""allowed_token_ids and bad_words on the worker: only allowed ids are ever
sampled (greedy and random), a one-token bad word never is, a longer one's
last token never follows the rest of it in the output."""
from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.logits_processors import LogitsAdjustments, bad_word_bans
from worker.sampler import Sampler, SamplingMetadata

VOCAB = 64


def sample(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
           num_prompt_tokens: list[int], refine: bool = False) -> list[int]:
    meta = SamplingMetadata.build(params, [len(t) - n for t, n in zip(token_ids, num_prompt_tokens)],
                                  token_ids=token_ids, num_prompt_tokens=num_prompt_tokens)
    if not refine:
        return Sampler(seed=1).sample(logits, meta).token_ids.tolist()
    hidden = torch.zeros(logits.shape[0], 4)
    return Sampler(seed=1).sample(logits, meta, ArgmaxRescoringHead(), hidden).token_ids.tolist()


class ArgmaxRescoringHead(PlainLogitsLmHead):
    """An lm_head that claims to re-score near ties: the sampler hands it the plain greedy rows."""

    def __init__(self):
        super().__init__(torch.zeros(VOCAB, 4))

    @property
    def rescores_near_ties(self) -> bool:
        return True

    def greedy_from_logits(self, logits: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return logits.index_select(0, rows).argmax(-1)


def test_allowed_token_ids_greedy_and_random_only_sample_allowed_ids():
    torch.manual_seed(0)
    allowed = [3, 17, 40]
    rows = 300
    logits = torch.randn(rows, VOCAB) * 3
    logits[:, 5] = 100.0  # by far the best token, but not allowed
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, allowed_token_ids=allowed),
              SamplingParams(temperature=0)]
    batch = [params[row % 3] for row in range(rows)]
    sampled = sample(logits.clone(), batch, [[1, 2]] * rows, [2] * rows)
    for row, token in enumerate(sampled):
        if row % 3 == 2:
            assert token == 5  # an unconstrained row in the same batch is untouched
        else:
            assert token in allowed
    # Random rows do spread over the allowed ids; greedy picks the best allowed one.
    assert {sampled[row] for row in range(1, rows, 3)} == set(allowed)
    for row in range(0, rows, 3):
        assert sampled[row] == max(allowed, key=lambda t: logits[row, t].item())


def test_allowed_rows_are_not_refined_as_plain_greedy():
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 10.0
    params = [SamplingParams(temperature=0, allowed_token_ids=[4]), SamplingParams(temperature=0)]
    assert sample(logits, params, [[1], [1]], [1, 1], refine=True) == [4, 9]
    assert sample(logits[:1].clone(), params[:1], [[1]], [1], refine=True) == [4]


def test_bad_word_bans_follow_the_output_only():
    words = [[7], [8, 9], [10, 11, 12]]
    assert bad_word_bans(words, [1, 2], 0) == [7]
    assert bad_word_bans(words, [1, 8], 1) == [7, 9]
    assert bad_word_bans(words, [8], 0) == [7]  # the prefix is in the prompt: no ban
    assert bad_word_bans(words, [1, 10, 11], 2) == [7, 12]
    assert bad_word_bans(words, [1, 10, 11], 1) == [7]  # 10 is the prompt's


def test_bad_words_are_never_completed_while_sampling():
    torch.manual_seed(3)
    rows = 200
    logits = torch.randn(rows, VOCAB)
    logits[:, 7] = 50.0  # a one-token bad word, by far the best
    logits[:, 9] = 45.0  # the end of bad word [8, 9]
    params = SamplingParams(temperature=0.7, bad_words_token_ids=[[7], [8, 9]])
    after_prefix = sample(logits.clone(), [params] * rows, [[1, 8]] * rows, [1] * rows)
    assert 7 not in after_prefix and 9 not in after_prefix
    elsewhere = sample(logits.clone(), [params] * rows, [[1, 3]] * rows, [1] * rows)
    assert 7 not in elsewhere and 9 in elsewhere  # 9 alone is fine


def test_nothing_is_built_for_bad_words_that_ban_nothing_this_step():
    params = [SamplingParams(bad_words_token_ids=[[8, 9]])]
    assert LogitsAdjustments.build(params, [[1, 2]], [1]) is None
    built = LogitsAdjustments.build(params, [[1, 8]], [1])
    assert built is not None and built.rows() == {0}
