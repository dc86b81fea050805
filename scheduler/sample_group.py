"""The samples of one request with n > 1 or best_of.

Sample 0 is admitted like any request. The others are created once its
prompt is computed (when it samples its first token): each forks from it,
sharing its full prompt blocks by ref count and computing only the rest of
the prompt (at least the last token, whose logits it samples its own first
token from). So the prompt is computed once however many samples there are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import EngineRequest
from scheduler.request import Request


@dataclass(slots=True, eq=False)
class SampleGroup:
    engine_request: EngineRequest
    num_samples: int
    samples: dict[int, Request] = field(default_factory=dict)  # created so far, by sample index
    num_unforked: int = 0  # samples not created yet (all but sample 0 until the fork)
    num_unfinished: int = 0  # samples not finished, the unforked ones included

    def __post_init__(self) -> None:
        self.num_unforked = self.num_samples - 1
        self.num_unfinished = self.num_samples

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @classmethod
    def resumed(cls, engine_request: EngineRequest, num_samples: int, samples: dict[int, Request]) -> "SampleGroup":
        """A resubmitted request (see `scheduler.resumption`): every unfinished
        sample exists from the start, each recomputing its own tokens (the prefix
        cache shares their prompt blocks); finished ones are done already."""
        group = cls(engine_request, num_samples, samples)
        group.num_unforked = 0
        group.num_unfinished = len(samples)
        return group

    def live_samples(self) -> list[Request]:
        return [r for r in self.samples.values() if not r.is_finished]

    def sample_finished(self, request: Request) -> None:
        self.num_unfinished -= 1
        if request.sample_index == 0 and self.num_unforked:
            # Ended before its prompt was computed (aborted): nothing to fork from.
            self.num_unfinished -= self.num_unforked
            self.num_unforked = 0

    def drop_unforked(self) -> None:
        """The whole request is aborted: samples not created yet never will be."""
        self.num_unfinished -= self.num_unforked
        self.num_unforked = 0

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0
