"""SamplingParams: validation naming the parameter, per-sample parameters,
and the wire format (old senders' messages still decode)."""
from __future__ import annotations

import math

import msgspec
import pytest

from common.errors import InvalidRequestError
from common.protocol import EngineRequest, parent_request_id, sample_request_id
from common.sampling_params import SamplingParams


@pytest.mark.parametrize("param, fields", [
    ("n", {"n": 0}), ("n", {"n": True}), ("best_of", {"n": 4, "best_of": 2}), ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": -1}), ("top_p", {"top_p": 0.0}), ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": 1.5}), ("seed", {"seed": 2**64}), ("presence_penalty", {"presence_penalty": 2.01}),
    ("frequency_penalty", {"frequency_penalty": math.inf}), ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("logit_bias", {"logit_bias": {3: 100.5}}), ("logit_bias", {"logit_bias": {-3: 1.0}}),
    ("max_tokens", {"max_tokens": 0}), ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("stop_token_ids", {"stop_token_ids": [-1]}), ("stop", {"stop": [3]}), ("logprobs", {"logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("allowed_token_ids", {"allowed_token_ids": []}), ("allowed_token_ids", {"allowed_token_ids": [3, -1]}),
    ("allowed_token_ids", {"allowed_token_ids": [True]}), ("bad_words", {"bad_words": ["ok", "  "]}),
    ("bad_words", {"bad_words": [3]}), ("bad_words", {"bad_words": ["w"] * 129}),
    ("bad_words", {"bad_words_token_ids": [[1], []]}), ("bad_words", {"bad_words_token_ids": [[1, -2]]}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 1.5}),
])
def test_invalid_values_name_their_parameter(param, fields):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**fields).validate()
    assert error.value.param == param and param in error.value.message


def test_token_ids_are_checked_against_the_vocabulary_when_known():
    params = SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[5])
    assert params.validate() is params
    with pytest.raises(InvalidRequestError) as error:
        params.validate(vocab_size=50)
    assert error.value.param == "logit_bias" and "99" in error.value.message
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(stop_token_ids=[50]).validate(vocab_size=50)
    assert error.value.param == "stop_token_ids"
    for fields, param in [({"allowed_token_ids": [49, 50]}, "allowed_token_ids"),
                          ({"bad_words_token_ids": [[3, 50]]}, "bad_words")]:
        assert SamplingParams(**fields).validate() is not None
        with pytest.raises(InvalidRequestError) as error:
            SamplingParams(**fields).validate(vocab_size=50)
        assert error.value.param == param and "50" in error.value.message


def test_each_sample_gets_its_own_seed_and_only_the_first_scores_the_prompt():
    params = SamplingParams(n=3, seed=2**64 - 2, prompt_logprobs=2, temperature=0.9)
    samples = [params.for_sample(i) for i in range(3)]
    assert [s.seed for s in samples] == [2**64 - 2, 2**64 - 1, 0]  # seed + index, wrapping at 64 bits
    assert [s.prompt_logprobs for s in samples] == [2, None, None]
    assert all(s.n == 1 and s.best_of is None and s.temperature == 0.9 for s in samples)
    assert all(s.logprobs is None for s in samples)
    ranked = SamplingParams(n=1, best_of=3)
    assert ranked.num_samples == 3 and ranked.for_sample(2).logprobs == 0  # best_of ranks by logprobs
    assert SamplingParams(logprobs=4).for_sample(0).logprobs == 4
    single = SamplingParams(seed=5)
    assert single.for_sample(0) is single


def test_wire_format_round_trip_and_old_messages():
    params = SamplingParams(n=2, logit_bias={7: -2.5}, stop=["x"], logprobs=3)
    request = EngineRequest(request_id="a", prompt_token_ids=[1], sampling_params=params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineRequest)
    assert decoded.sampling_params == params and decoded.sampling_params.logit_bias == {7: -2.5}
    old = msgspec.msgpack.encode({"request_id": "b", "prompt_token_ids": [1],
                                  "sampling_params": {"temperature": 0.5, "max_tokens": 3}})
    assert msgspec.msgpack.decode(old, type=EngineRequest).sampling_params == SamplingParams(temperature=0.5,
                                                                                              max_tokens=3)


def test_sample_ids():
    assert parent_request_id(sample_request_id("cmpl-1", 3)) == "cmpl-1"
    assert parent_request_id("plain") == "plain" and parent_request_id("a#b") == "a#b"


def test_truncate_prompt_keeps_the_last_tokens():
    from common.prompt_truncation import truncate_prompt
    ids = list(range(10))
    assert truncate_prompt(ids, None, 8) == ids
    assert truncate_prompt(ids, 3, 8) == [7, 8, 9]
    assert truncate_prompt(ids, 20, None) == ids
    assert truncate_prompt(ids, -1, 8) == ids[2:]
    assert truncate_prompt(ids, -1, None) == ids
    with pytest.raises(InvalidRequestError, match="greater than max_model_len") as error:
        truncate_prompt(ids, 9, 8)
    assert error.value.param == "truncate_prompt_tokens"


def test_bad_words_keep_the_spaced_spelling_only_when_it_is_another_word_of_the_same_length():
    from common.bad_words import bad_words_token_ids, spellings, with_bad_words_tokenized
    assert spellings("  hi there") == ("hi there", " hi there")
    encoded = [([5], [6]), ([5, 7], [5, 8]), ([9], [10, 11]), ([12, 13], [14, 15])]
    assert bad_words_token_ids(["a", "b", "c", "d"], encoded) == [[5], [6], [5, 7], [9], [12, 13], [14, 15]]
    with pytest.raises(InvalidRequestError) as error:
        bad_words_token_ids(["x"], [([], [3])])
    assert error.value.param == "bad_words"
    vocab = {"bad": [40], " bad": [41]}
    params = with_bad_words_tokenized(SamplingParams(bad_words=[" bad"]), vocab.__getitem__)
    assert params.bad_words_token_ids == [[40], [41]]
    assert with_bad_words_tokenized(SamplingParams(), vocab.__getitem__).bad_words_token_ids == []


def test_max_logprobs_bounds_logprobs_and_minus_one_means_the_vocabulary():
    SamplingParams(logprobs=50, prompt_logprobs=50).validate(max_logprobs=50)
    with pytest.raises(InvalidRequestError, match="between 0 and 50"):
        SamplingParams(logprobs=51).validate(max_logprobs=50)
    SamplingParams(logprobs=100).validate(vocab_size=100, max_logprobs=-1)
    with pytest.raises(InvalidRequestError, match="between 0 and 100"):
        SamplingParams(prompt_logprobs=101).validate(vocab_size=100, max_logprobs=-1)
    SamplingParams(logprobs=10**6).validate(max_logprobs=-1)  # the vocabulary not known: the worker's check
