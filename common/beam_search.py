"""Beam search as vLLM runs it, over any engine that can score one next token.

Each step extends every live beam by one token: the engine generates one token
for each beam's sequence with `2 * beam_width` top logprobs (the model's raw
log-softmax), and every (beam, top token) pair becomes a candidate whose
cumulative logprob is the beam's plus the token's. A candidate ending in EOS
(unless `ignore_eos`) is a finished sequence; of the others the `beam_width`
with the best score live on. After `max_tokens` steps the live beams join the
finished ones, and the `beam_width` best by score are the result, best first.

The score is vLLM's: cumulative logprob / length ** length_penalty, the length
counting the prompt and the output without its final EOS.

Unlike vLLM, the search also stops early, but only when it cannot change the
result: once `beam_width` sequences have finished and no live beam, whatever
tokens come next, could score above the worst of the best `beam_width`
finished ones (logprobs are never positive, so a beam's cumulative logprob
only falls). Pure Python: the HTTP frontend and the offline `LLM` both drive it.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from common.errors import InvalidRequestError
from common.sampling_params import MAX_LOGPROBS, MAX_SAMPLES, SamplingParams, logprobs_bound


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int | None = None  # None: as many as fit in the context
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the final EOS in the output tokens

    def validate(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        """`max_logprobs`: the engine's --max-logprobs, which each step's 2 * beam_width logprobs must fit."""
        bound = logprobs_bound(None, max_logprobs)
        most = MAX_SAMPLES if bound is None else min(bound // 2, MAX_SAMPLES)
        if not 1 <= self.beam_width <= most:
            raise InvalidRequestError(f"beam search takes 1 to {most} beams (n), not {self.beam_width}: each "
                                      f"step ranks 2 * n tokens per beam (--max-logprobs {max_logprobs})", param="n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        if not math.isfinite(self.length_penalty):  # NaN would make the ranking arbitrary
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty}",
                                      param="length_penalty")

    def step_params(self) -> SamplingParams:
        """What the engine runs for one beam's next token: only its top logprobs are used."""
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * self.beam_width,
                              skip_special_tokens=False)


@dataclass(frozen=True, slots=True)
class Beam:
    token_ids: tuple[int, ...]  # the output so far (with the final EOS when finished by it)
    cumulative_logprob: float
    finished_by_eos: bool = False


@dataclass(slots=True)
class BeamSearch:
    params: BeamSearchParams
    num_prompt_tokens: int
    eos_token_ids: Collection[int]
    max_model_len: int
    live: list[Beam] = field(default_factory=lambda: [Beam((), 0.0)])
    finished: list[Beam] = field(default_factory=list)
    steps: int = 0

    @property
    def max_tokens(self) -> int:
        if self.params.max_tokens is not None:
            return self.params.max_tokens
        return self.max_model_len - self.num_prompt_tokens

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.max_tokens or self._cannot_improve()

    def next_inputs(self, prompt_token_ids: Sequence[int]) -> list[list[int]]:
        """The sequence of each live beam, whose next token the engine scores."""
        return [[*prompt_token_ids, *beam.token_ids] for beam in self.live]

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """`tops[i]`: live beam i's most likely next tokens, as (token id, logprob)."""
        candidates = []
        for beam, top in zip(self.live, tops, strict=True):
            for token_id, logprob in top:
                candidate = Beam((*beam.token_ids, token_id), beam.cumulative_logprob + logprob)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    self.finished.append(Beam(candidate.token_ids, candidate.cumulative_logprob, True))
                else:
                    candidates.append(candidate)
        candidates.sort(key=self.score, reverse=True)
        self.live = candidates[:self.params.beam_width]
        self.steps += 1

    def results(self) -> list[Beam]:
        """The best `beam_width` sequences, best first (call once `done`)."""
        return sorted([*self.finished, *self.live], key=self.score, reverse=True)[:self.params.beam_width]

    def output_token_ids(self, beam: Beam) -> list[int]:
        if beam.finished_by_eos and not self.params.include_stop_str_in_output:
            return list(beam.token_ids[:-1])
        return list(beam.token_ids)

    def score(self, beam: Beam) -> float:
        length = self.num_prompt_tokens + len(beam.token_ids) - (1 if beam.finished_by_eos else 0)
        return self._length_scaled(beam.cumulative_logprob, length)

    def _cannot_improve(self) -> bool:
        width = self.params.beam_width
        if len(self.finished) < width:
            return False
        worst_kept = sorted(map(self.score, self.finished), reverse=True)[width - 1]
        return all(self._best_reachable(beam) < worst_kept for beam in self.live)

    def _best_reachable(self, beam: Beam) -> float:
        """An upper bound on the score of anything `beam` can still become: its
        cumulative logprob cannot rise; the length term favours the longest
        reachable output when length_penalty > 0, the current one otherwise."""
        length = self.num_prompt_tokens + len(beam.token_ids)
        if self.params.length_penalty > 0:
            length = self.num_prompt_tokens + self.max_tokens
        return self._length_scaled(beam.cumulative_logprob, length)

    def _length_scaled(self, cumulative_logprob: float, length: int) -> float:
        """cumulative_logprob / length ** length_penalty, saturating where a large
        penalty would overflow the power (an OverflowError) or underflow it to 0."""
        try:
            divisor = length ** self.params.length_penalty
        except OverflowError:
            return -0.0
        if divisor == 0.0:
            return -math.inf if cumulative_logprob < 0 else 0.0
        return cumulative_logprob / divisor
