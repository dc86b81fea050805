"""The beam search core (`common.beam_search`) against the plainly written
reference, on toy models whose next-token distribution is a seeded function
of the sequence: the same sequences and scores, best first, whether or not the
early stop cuts the search short."""
from __future__ import annotations

import math
import random

import pytest

from beam_search_reference import reference_beam_search
from common.beam_search import BeamSearch, BeamSearchParams
from common.errors import InvalidRequestError

VOCAB, EOS = 7, 0


def toy_model(seed: int, eos_weight: float = 1.0):
    def next_logprobs(sequence: list[int]) -> list[float]:
        rng = random.Random(hash((seed, *sequence)))
        weights = [rng.random() ** 3 for _ in range(VOCAB)]
        weights[EOS] *= eos_weight
        total = sum(weights)
        return [math.log(w / total) for w in weights]
    return next_logprobs


class SearchWithoutEarlyStop(BeamSearch):
    def _cannot_improve(self) -> bool:
        return False


def run(next_logprobs, prompt: list[int], params: BeamSearchParams, early_stop: bool = True) -> BeamSearch:
    search = (BeamSearch if early_stop else SearchWithoutEarlyStop)(params, len(prompt), {EOS}, max_model_len=64)
    while not search.done:
        tops = []
        for sequence in search.next_inputs(prompt):
            logprobs = next_logprobs(sequence)
            ranked = sorted(range(VOCAB), key=lambda t: (-logprobs[t], t))[:2 * params.beam_width]
            tops.append([(t, logprobs[t]) for t in ranked])
        search.advance(tops)
    return search


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("beam_width, length_penalty", [(1, 1.0), (2, 1.0), (3, 0.0), (3, 2.0), (2, -1.0)])
def test_the_same_sequences_as_the_reference(seed, beam_width, length_penalty):
    model, prompt = toy_model(seed, eos_weight=3.0), [1 + seed % 5, 2]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=6, length_penalty=length_penalty,
                              include_stop_str_in_output=True)
    search = run(model, prompt, params)
    got = [(list(beam.token_ids), beam.cumulative_logprob) for beam in search.results()]
    expected = reference_beam_search(model, prompt, beam_width, 6, {EOS}, length_penalty)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert [c for _, c in got] == pytest.approx([c for _, c in expected])


@pytest.mark.parametrize("seed", range(40))
def test_the_early_stop_never_changes_the_result(seed):
    model, params = toy_model(seed, eos_weight=8.0), BeamSearchParams(beam_width=2, max_tokens=12)
    early, full = run(model, [3], params), run(model, [3], params, early_stop=False)
    assert early.results() == full.results() and early.steps <= full.steps


def test_the_early_stop_saves_steps_when_eos_is_likely():
    steps = [run(toy_model(seed, eos_weight=50.0), [3], BeamSearchParams(beam_width=2, max_tokens=12)).steps
             for seed in range(20)]
    assert min(steps) < 12


def test_one_beam_is_greedy():
    model, prompt = toy_model(7), [4]
    search = run(model, prompt, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    greedy = []
    for _ in range(8):
        logprobs = model(prompt + greedy)
        greedy.append(max(range(VOCAB), key=lambda t: (logprobs[t], -t)))
    assert list(search.results()[0].token_ids) == greedy


def test_a_final_eos_is_in_the_output_only_when_asked():
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    search = run(toy_model(3, eos_weight=50.0), [2], params)
    beam = next(b for b in search.results() if b.finished_by_eos)
    assert beam.token_ids[-1] == EOS and search.output_token_ids(beam) == list(beam.token_ids[:-1])
    kept = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=6, include_stop_str_in_output=True), 1, {EOS}, 64)
    assert kept.output_token_ids(beam) == list(beam.token_ids)


def test_max_tokens_none_fills_the_context():
    assert BeamSearch(BeamSearchParams(beam_width=2), num_prompt_tokens=10, eos_token_ids={EOS},
                      max_model_len=64).max_tokens == 54


@pytest.mark.parametrize("params, param", [(BeamSearchParams(beam_width=11), "n"),
                                           (BeamSearchParams(beam_width=0), "n"),
                                           (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
                                           (BeamSearchParams(beam_width=2, length_penalty=math.nan), "length_penalty"),
                                           (BeamSearchParams(beam_width=2, length_penalty=math.inf), "length_penalty")])
def test_bad_settings_name_the_field(params, param):
    with pytest.raises(InvalidRequestError) as refused:
        params.validate()
    assert refused.value.param == param


@pytest.mark.parametrize("length_penalty", [1e308, -1e308])
def test_an_extreme_length_penalty_ranks_without_overflowing(length_penalty):
    # length ** 1e308 overflows (a float OverflowError), length ** -1e308 is 0.0: neither may crash the search.
    search = run(toy_model(5, eos_weight=3.0), [2, 3], BeamSearchParams(beam_width=3, max_tokens=4,
                                                                       length_penalty=length_penalty))
    assert len(search.results()) == 3
