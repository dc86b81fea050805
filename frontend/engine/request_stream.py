"""The frontend's end of one request in flight: the queue its outputs arrive
on, and what it needs to resubmit the request to a scheduler that lost it.

A scheduler that dies (or drops a frontend it thought gone) takes its requests
with it, but everything needed to carry on is here: the request as first
sent, each sample's output tokens so far, which samples have finished and
whether the prompt logprobs came. `resubmission()` builds the request a new
scheduler continues from (see `scheduler.resumption`); its `attempt` lets the
stream drop any late output of the attempt it replaces.
"""
from __future__ import annotations

import asyncio

import msgspec

from common.protocol import EngineRequest, RequestOutput, ResumedSample


class RequestStream:
    __slots__ = ("request", "queue", "finished", "attempt", "needs_resubmit", "output_token_ids",
                 "finished_samples", "prompt_logprobs_received")

    def __init__(self, request: EngineRequest):
        self.request = request
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.finished = False  # the scheduler no longer holds it (or is gone)
        self.attempt = request.attempt
        self.needs_resubmit = False  # the scheduler lost it (or never got it): resubmit on (re)connect
        self.output_token_ids: dict[int, list[int]] = {}  # by sample index
        self.finished_samples: set[int] = set()
        self.prompt_logprobs_received = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def accept(self, output: RequestOutput) -> bool:
        """Record an output of the current attempt and queue it; False (dropped) for a stale one."""
        if output.attempt != self.attempt:
            return False
        if output.new_token_ids:
            self.output_token_ids.setdefault(output.index, []).extend(output.new_token_ids)
        if output.finish_reason is not None:
            self.finished_samples.add(output.index)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs_received = True
        self.queue.put_nowait(output)
        return True

    def sample_stopped(self, index: int) -> None:
        """The frontend ended this sample itself (a stop string): never resume it."""
        if 0 <= index < self.request.sampling_params.num_samples:
            self.finished_samples.add(index)

    def resubmission(self) -> EngineRequest:
        """The request for a scheduler that does not hold it: the next attempt,
        carrying every sample's tokens so far."""
        self.attempt += 1
        self.needs_resubmit = False
        params = self.request.sampling_params
        if self.prompt_logprobs_received and params.prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=None)  # the client has them
        resumed = [ResumedSample(index=index, output_token_ids=list(self.output_token_ids.get(index, ())),
                                 finished=index in self.finished_samples)
                   for index in sorted(set(self.output_token_ids) | self.finished_samples)]
        return msgspec.structs.replace(self.request, sampling_params=params, attempt=self.attempt, resumed=resumed)
