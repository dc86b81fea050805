"""`LLM.beam_search` on a tiny random Llama against the plainly written
reference search (`beam_search_reference`) run on transformers' float32
log-softmax: the same scores, best first, and each sequence's cumulative
logprob is what transformers gives its tokens. (Sequences are compared by
score: a near tie between two candidates may fall either way.)"""
from __future__ import annotations

import random

import pytest
import torch

from beam_search_reference import reference_beam_search
from common.beam_search import BeamSearchParams
from common.errors import InvalidRequestError
from tiny_models import tiny_llama_engine

EOS = 2  # LlamaConfig's default eos_token_id


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_engine(tmp_path_factory.mktemp("tiny-llama-beams"), num_gpu_blocks_override=300,
                             max_model_len=64, enforce_eager=True)


def hf_logprobs(hf_model, sequence: list[int]) -> list[float]:
    with torch.no_grad():
        return hf_model(torch.tensor([sequence])).logits[0, -1].float().log_softmax(-1).tolist()


def score(prompt: list[int], tokens: list[int], cumulative: float, length_penalty: float) -> float:
    return cumulative / ((len(prompt) + len(tokens) - (tokens[-1:] == [EOS])) ** length_penalty)


@pytest.mark.parametrize("beam_width, length_penalty, ignore_eos", [(3, 1.0, False), (2, 0.5, True), (1, 1.0, True)])
def test_the_best_sequences_score_as_the_reference(tiny, beam_width, length_penalty, ignore_eos):
    hf_model, llm = tiny
    rng = random.Random(beam_width)
    prompts = [[rng.randrange(3, 250) for _ in range(length)] for length in (5, 11)]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=5, length_penalty=length_penalty,
                              ignore_eos=ignore_eos, include_stop_str_in_output=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        expected = reference_beam_search(lambda s: hf_logprobs(hf_model, s), prompt, beam_width, 5, {EOS},
                                         length_penalty, ignore_eos)
        got = output.outputs
        assert output.prompt_token_ids == prompt and len(got) == len(expected) == beam_width
        assert [score(prompt, o.token_ids, o.cumulative_logprob, length_penalty) for o in got] == pytest.approx(
            [score(prompt, tokens, cumulative, length_penalty) for tokens, cumulative in expected], abs=1e-4)
        for o in got:
            logprobs = [hf_logprobs(hf_model, prompt + o.token_ids[:i])[t] for i, t in enumerate(o.token_ids)]
            assert o.cumulative_logprob == pytest.approx(sum(logprobs), abs=1e-4)
            assert o.finish_reason == ("stop" if o.token_ids[-1] == EOS and not ignore_eos else "length")


def test_one_beam_is_greedy(tiny):
    from common.sampling_params import SamplingParams

    _, llm = tiny
    prompt = {"prompt_token_ids": [5, 17, 99, 4]}
    [greedy] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    [beams] = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    assert beams.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_a_search_past_the_context_is_refused_before_any_step(tiny):
    _, llm = tiny
    with pytest.raises(InvalidRequestError) as refused:
        llm.beam_search({"prompt_token_ids": list(range(3, 63))}, BeamSearchParams(beam_width=2, max_tokens=8))
    assert refused.value.param == "max_tokens"


def test_max_logprobs_widens_what_the_engine_takes(tmp_path):
    from common.sampling_params import SamplingParams

    _, llm = tiny_llama_engine(tmp_path, num_gpu_blocks_override=100, enforce_eager=True, max_logprobs=40)
    prompt = {"prompt_token_ids": [5, 17, 99]}
    [out] = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=40, prompt_logprobs=40), use_tqdm=False)
    assert all(len(entry.top_token_ids) == 40 for entry in out.outputs[0].logprobs)
    assert len(llm.beam_search(prompt, BeamSearchParams(beam_width=20, max_tokens=2))[0].outputs) == 20
    with pytest.raises(InvalidRequestError):
        llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=41), use_tqdm=False)
