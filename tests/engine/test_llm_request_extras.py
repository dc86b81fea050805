"""vLLM's request extras in the offline engine (tiny random Llama, SmolLM2's
tokenizer): allowed_token_ids, bad_words (tokenized here, banned on the
worker) and truncate_prompt_tokens."""
from __future__ import annotations

import pytest

from common.bad_words import spellings
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from tiny_models import build_tiny_llama_with_smollm2_tokenizer
from pagedserve.offline.llm import LLM

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-extras")
    build_tiny_llama_with_smollm2_tokenizer(directory)
    return LLM(model=str(directory), dtype="float32", device="cpu", attention_backend="torch", block_size=4,
               num_gpu_blocks_override=200, seed=0, enforce_eager=True, max_model_len=64)


def output_ids(llm: LLM, prompt, **fields) -> list[int]:
    params = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **fields})
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_allowed_token_ids_are_the_only_ones_sampled(llm, temperature):
    allowed = [100, 2000, 30000]
    got = output_ids(llm, PROMPT, temperature=temperature, seed=1, allowed_token_ids=allowed)
    assert len(got) == 12 and set(got) <= set(allowed)
    assert not set(output_ids(llm, PROMPT, temperature=temperature, seed=1)) <= set(allowed)


def test_a_one_token_bad_word_is_never_sampled_in_either_spelling(llm):
    word = "hello"
    plain, spaced = (llm.tokenizer.encode(text, add_special_tokens=False) for text in spellings(word))
    assert len(plain) == len(spaced) == 1 and plain != spaced
    forced = {plain[0]: 100.0, spaced[0]: 99.0}  # without the ban, greedy picks them every time
    assert set(output_ids(llm, PROMPT, temperature=0, logit_bias=forced)) <= set(forced)
    got = output_ids(llm, PROMPT, temperature=0, logit_bias=forced, bad_words=[" " + word])
    assert plain[0] not in got and spaced[0] not in got


def test_a_longer_bad_words_last_token_never_follows_the_rest(llm):
    word = "Zyx"
    first, last = llm.tokenizer.encode(word, add_special_tokens=False)  # two tokens
    pairs = lambda out: sum(a == first and b == last for a, b in zip(out, out[1:]))  # noqa: E731
    fields = dict(temperature=2.0, seed=3, allowed_token_ids=[first, last])
    free = output_ids(llm, PROMPT, **fields)
    assert pairs(free) > 0  # the pair does come up without the ban
    assert pairs(output_ids(llm, PROMPT, bad_words=[word], **fields)) == 0


def test_truncation_runs_the_prompts_last_tokens(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                              truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:]
    assert out.outputs[0].token_ids == output_ids(llm, {"prompt_token_ids": ids[-4:]}, temperature=0,
                                                  max_tokens=8)
    whole = output_ids(llm, PROMPT, temperature=0, max_tokens=8)
    assert output_ids(llm, PROMPT, temperature=0, max_tokens=8, truncate_prompt_tokens=-1) == whole


def test_bad_input_is_an_invalid_request(llm):
    for fields, param in [({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                          ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
                          ({"bad_words": [""]}, "bad_words")]:
        with pytest.raises(InvalidRequestError) as error:
            llm.generate(PROMPT, SamplingParams(**fields), use_tqdm=False)
        assert error.value.param == param
