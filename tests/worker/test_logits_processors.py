"""Logits adjustments on the same logits as the references: transformers'
RepetitionPenaltyLogitsProcessor, OpenAI's presence/frequency formula,
logit_bias added before sampling, min_tokens masking EOS and stop tokens."""
from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from common.sampling_params import SamplingParams
from worker.logits_processors import LogitsAdjustments, token_counts
from worker.sampler import Sampler, SamplingMetadata

VOCAB = 64
EOS = 2


def adjusted(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
             num_prompt_tokens: list[int]) -> torch.Tensor:
    adjustments = LogitsAdjustments.build(params, token_ids, num_prompt_tokens, eos_token_ids=[EOS])
    assert adjustments is not None
    return adjustments.apply(logits.clone())


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4  # positive and negative logits
    sequences = [[5, 9, 9, 30, 7, 1], [1, 2, 3, 4, 5, 6, 7, 8], [63, 0, 17, 17, 17, 40]]
    prompt_lens = [2, 8, 3]  # over prompt and output alike: where the prompt ends does not matter
    expected = torch.cat([RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seq]), logits[i:i + 1].clone())
                          for i, seq in enumerate(sequences)])
    got = adjusted(logits, [SamplingParams(repetition_penalty=penalty)] * 3, sequences, prompt_lens)
    assert torch.equal(got, expected)


def test_presence_and_frequency_follow_openais_formula_over_generated_tokens():
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    prompt = [4, 4, 11]  # prompt tokens are not penalized
    outputs = [[4, 20, 20, 20, 33], [11]]
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(presence_penalty=-0.5, frequency_penalty=1.5)]
    got = adjusted(logits, params, [prompt + out for out in outputs], [len(prompt)] * 2)
    expected = logits.clone()
    for row, (p, out) in enumerate(zip(params, outputs)):
        for token in set(out):
            count = out.count(token)
            expected[row, token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert got[0, 11] == logits[0, 11]  # in the prompt only


def test_logit_bias_is_added_and_decides_greedy():
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0, 8: -3.5}), SamplingParams(temperature=0)]
    got = adjusted(logits, params, [[1, 2], [1, 2]], [2, 2])
    expected = logits.clone()
    expected[0, 7] += 100.0
    expected[0, 8] -= 3.5
    assert torch.equal(got, expected)
    meta = SamplingMetadata.build(params, [0, 0], token_ids=[[1, 2], [1, 2]], num_prompt_tokens=[2, 2])
    assert Sampler()(logits.clone(), meta).tolist() == [7, logits[1].argmax().item()]
    # -100 bans a token even at temperature 1.
    banned = SamplingParams(seed=3, logit_bias={int(logits[1].argmax()): -100.0})
    meta = SamplingMetadata.build([banned] * 200, [0] * 200, token_ids=[[1]] * 200, num_prompt_tokens=[1] * 200)
    assert int(logits[1].argmax()) not in Sampler()(logits[1:2].expand(200, -1).clone(), meta).tolist()


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 50.0  # EOS is by far the most likely
    logits[:, 9] = 40.0  # then a stop token
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9]),  # 1 output so far: masked
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9]),  # 3 outputs: min reached
              SamplingParams(temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[9]),
              SamplingParams(temperature=0, min_tokens=2)]
    token_ids = [[1, 5], [1, 5, 6, 7], [1, 5], [1, 5]]
    meta = SamplingMetadata.build(params, [1, 3, 1, 1], token_ids=token_ids, num_prompt_tokens=[1] * 4,
                                  eos_token_ids=[EOS])
    sampled = Sampler()(logits.clone(), meta).tolist()
    assert sampled[0] not in (EOS, 9)
    assert sampled[1] == EOS
    assert sampled[2] == EOS  # ignore_eos: EOS is no stop token, so min_tokens leaves it alone
    assert sampled[3] == 9  # 9 is no stop token here


def test_steps_without_adjustments_build_nothing_and_out_of_vocab_ids_are_ignored():
    assert LogitsAdjustments.build([SamplingParams()] * 3, [[1]] * 3, [1] * 3) is None
    logits = torch.zeros(1, VOCAB)
    got = adjusted(logits, [SamplingParams(logit_bias={VOCAB + 5: 1.0, 3: 2.0}, repetition_penalty=2.0)],
                   [[1, VOCAB + 9]], [1])
    assert got[0, 3] == 2.0 and got.sum() == 2.0


def test_token_counts():
    counts = token_counts([[1, 1, 3], [], [0, 5, 5, 5]], 6, "cpu")
    assert counts.tolist() == [[0, 2, 0, 1, 0, 0], [0] * 6, [1, 0, 0, 0, 0, 3]]


def test_raw_logprobs_come_before_the_adjustments():
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={5: 100.0}, repetition_penalty=1.7),
              SamplingParams(temperature=0)]
    meta = SamplingMetadata.build(params, [0, 0], token_ids=[[5, 6], [1]], num_prompt_tokens=[2, 1])
    output = Sampler().sample(logits.clone(), meta)
    assert output.token_ids[0] == 5 and output.logprobs[1] is None
    entry = output.logprobs[0]
    reference = logits[0].log_softmax(-1)
    assert entry.token_id == 5 and entry.logprob == pytest.approx(reference[5].item(), abs=1e-6)
    assert entry.rank == int((reference > reference[5]).sum()) + 1
    assert entry.top_token_ids == reference.topk(3).indices.tolist()
    assert entry.top_logprobs == pytest.approx(reference.topk(3).values.tolist(), abs=1e-6)


def dense_penalties(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                    num_prompt_tokens: list[int]) -> torch.Tensor:
    """The penalties over whole rows, as masks and counts (the formulas of the module docstrings)."""
    out = logits.clone()
    vocab = logits.shape[1]
    for row, (p, ids, n) in enumerate(zip(params, token_ids, num_prompt_tokens)):
        in_vocab = [t for t in ids if 0 <= t < vocab]
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[in_vocab] = True
        counts = torch.bincount(torch.tensor([t for t in ids[n:] if 0 <= t < vocab], dtype=torch.int64),
                                minlength=vocab).float()
        penalty = torch.tensor(p.repetition_penalty, dtype=torch.float32)
        values = torch.where(seen, torch.where(out[row] < 0, out[row] * penalty, out[row] / penalty), out[row])
        values = (values - torch.tensor(p.frequency_penalty, dtype=torch.float32) * counts
                  - torch.tensor(p.presence_penalty, dtype=torch.float32) * (counts > 0).float())
        out[row] = values
    return out


def test_penalties_on_distinct_tokens_equal_whole_row_penalties_bit_for_bit():
    torch.manual_seed(7)
    rows, vocab = 40, 500
    logits = torch.randn(rows, vocab) * 5
    params, token_ids, prompt_lens = [], [], []
    for row in range(rows):
        kind = row % 4  # repetition alone, frequency/presence alone, both, none
        params.append(SamplingParams(repetition_penalty=1.0 if kind in (1, 3) else 1.0 + row / 20,
                                     frequency_penalty=0.0 if kind in (0, 3) else -1.0 + row / 13,
                                     presence_penalty=0.0 if kind in (0, 3) else 0.3))
        ids = torch.randint(0, vocab // 3, (int(torch.randint(0, 60, ())),)).tolist()
        if row % 5 == 0:
            ids += [vocab + 3, 2 ** 40]  # not in the vocabulary: ignored
        token_ids.append(ids)
        prompt_lens.append(min(len(ids), int(torch.randint(0, 30, ()))))
    assert torch.equal(adjusted(logits, params, token_ids, prompt_lens),
                       dense_penalties(logits, params, token_ids, prompt_lens))
