"""The pieces of speculative decoding: the config as vLLM spells it, prompt lookup,
the verification rule, and the batch rows of a request with drafts."""
from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.errors import ConfigError
from common.protocol import CachedRequestData, NewRequestData, StepPlan, TokenLogprobs
from common.sampling_params import SamplingParams
from common.speculative_config import SpeculativeConfig
from worker.input_batch import InputBatch
from worker.spec_decode.ngram_proposer import NgramProposer
from worker.spec_decode.verification import verify


def test_config_takes_vllm_json_and_its_older_spelling():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
                                     '"prompt_lookup_min": 1}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (
        "ngram", 5, 3, 1)
    legacy = SpeculativeConfig.parse({"speculative_model": "[ngram]", "num_speculative_tokens": 2,
                                      "ngram_prompt_lookup_max": 4})
    assert (legacy.method, legacy.prompt_lookup_max) == ("ngram", 4)
    draft = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.lookahead_slots) == ("draft_model", "/m", 3)
    assert SpeculativeConfig.parse(config.to_json()) == config
    assert SpeculativeConfig.parse("") is None
    assert EngineConfig(device="cpu", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'
                        ).speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"), ("[1]", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to 16"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
])
def test_bad_configs_are_refused_with_the_reason(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_speculation_runs_on_one_rank_only():
    with pytest.raises(ConfigError, match="one worker rank"):
        EngineConfig(device="cpu", tensor_parallel_size=2,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_prompt_lookup_takes_the_latest_of_the_longest_matches():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=2))
    # "7 8" occurs at 0 and 5; "6 7 8" only at 4: the longer match wins, its continuation follows.
    assert proposer.propose_one([7, 8, 1, 2, 6, 7, 8, 3, 4, 5, 6, 7, 8]) == [3, 4, 5]
    # Two matches of the same length: the latest.
    assert proposer.propose_one([1, 2, 10, 1, 2, 20, 21, 1, 2]) == [20, 21, 1]
    # The continuation may run into the suffix itself, and stops at the sequence's end.
    assert proposer.propose_one([4, 5, 4, 5]) == [4, 5]
    assert proposer.propose_one([1, 2, 3, 4]) == []  # nothing recurs
    assert proposer.propose_one([1, 2, 9, 2]) == []  # one token only: below prompt_lookup_min
    assert proposer.propose_one([1, 2, 3, 1, 2], k=1) == [3]


def test_verification_accepts_the_agreeing_prefix_and_one_more_token():
    drafts = [[5, 6, 7], [], [1, 2]]
    rows = [5, 6, 9, 4,  # agrees twice, then samples 9 instead of 7 (4 is never used)
            8,  # no drafts: its own token
            1, 2, 3]  # all accepted, then the bonus 3
    result = verify(drafts, rows)
    assert result.accepted == [[5, 6], [], [1, 2]]
    assert result.tokens == [9, 8, 3]
    entries = [TokenLogprobs(token_id=t, logprob=-float(i), rank=1) for i, t in enumerate(rows)]
    with_logprobs = verify(drafts, rows, entries)
    assert [e.token_id for e in with_logprobs.draft_logprobs[0]] == [5, 6]
    assert [e.token_id for e in with_logprobs.logprobs] == [9, 8, 3]
    with pytest.raises(ValueError, match="checked positions"):
        verify(drafts, rows[:-1])


def test_a_request_with_drafts_gets_a_row_per_checked_position():
    batch = InputBatch(block_size=4)
    params = SamplingParams(temperature=0.5, seed=3, presence_penalty=0.5, max_tokens=20)
    batch.apply_plan(StepPlan(step_id=0, new_requests=[
        NewRequestData(request_id="a", token_ids=[1, 2, 3, 4, 5], num_prompt_tokens=4, sampling_params=params,
                       block_ids=[1, 2], num_computed_tokens=4),
        NewRequestData(request_id="b", token_ids=[9, 9, 9], num_prompt_tokens=3, sampling_params=params,
                       block_ids=[3], num_computed_tokens=2)]))
    step = batch.build({"a": 4, "b": 1}, {"a": [6, 7, 8]})
    assert step.input_ids.tolist() == [9, 5, 6, 7, 8]  # the decode first, then a's token and its drafts
    assert step.positions.tolist() == [2, 4, 5, 6, 7]
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4]
    assert step.rows_per_request == [1, 4]
    # Row i of "a" samples as the request would after accepting i drafts: its seed's noise for
    # that output index, its penalties over those tokens.
    meta = step.sampling_metadata
    assert meta.num_rows == 5
    from worker.sampler import step_seed
    assert sorted(meta.seeds.values()) == sorted([step_seed(3, 0)] + [step_seed(3, 1 + i) for i in range(4)])
    step.commit([4, 8], [[], [6]])  # b: 4; a: accepted 6, then 8
    a, b = batch.requests["a"], batch.requests["b"]
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 8] and a.num_computed_tokens == 6
    assert b.token_ids == [9, 9, 9, 4] and b.num_computed_tokens == 3
    # The scheduler gave back a's block past its next slot: the diff says how many stay.
    batch.apply_plan(StepPlan(step_id=1, cached_requests=[CachedRequestData(
        request_id="a", new_block_ids=[7], num_computed_tokens=6, num_blocks_kept=2)]))
    assert a.block_ids == [1, 2, 7]
    with pytest.raises(ValueError, match="drafts need one decode token"):
        batch.build({"a": 3}, {"a": [1]})
    assert torch.equal(step.positions, torch.tensor([2, 4, 5, 6, 7]))
