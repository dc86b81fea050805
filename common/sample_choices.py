"""A sample's whole result, and picking the returned choices among samples
(best_of: the n samples with the highest cumulative logprob).

Pure Python, shared by the HTTP and gRPC APIs and the offline `LLM`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import TokenLogprobs
from common.output_decoder import DecodedDelta


@dataclass(slots=True)
class SampleResult:
    index: int  # the sample's index in the request
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: DecodedDelta) -> None:
        self.token_ids += delta.token_ids
        self.pieces.append(delta.text)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the sampled tokens' logprobs (None without logprobs)."""
        return None if self.logprobs is None else sum(entry.logprob for entry in self.logprobs)


def best_samples(samples: list[SampleResult], n: int) -> list[SampleResult]:
    """The choices to return: all samples in index order when there are n of
    them, else (best_of) the n with the highest cumulative logprob, best
    first, as vLLM returns them."""
    ordered = sorted(samples, key=lambda s: s.index)
    if len(ordered) <= n:
        return ordered
    def score(sample: SampleResult) -> float:
        value = sample.cumulative_logprob
        return float("-inf") if value is None else value
    return sorted(ordered, key=score, reverse=True)[:n]
