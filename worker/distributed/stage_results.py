"""A pipeline step's outcome, from the last stage to every other rank.

Only the last stage computes logits; the other stages still keep every
request's tokens (their next step's inputs) and rank 0 answers the scheduler.
The result rank (tensor rank 0 of the last stage) broadcasts the sampled
tokens and logprobs as a StepResult's wire encoding; every rank, the result
rank included, then commits exactly those tokens.
"""
from __future__ import annotations

from common.protocol import MessageType, StepResult
from worker.distributed import parallel_state
from worker.distributed.group_channel import GroupChannel


class StageResults:
    def __init__(self) -> None:
        self.channel = GroupChannel(parallel_state.layout().result_rank, (MessageType.STEP_RESULT,))

    def share(self, result: StepResult) -> StepResult:
        """On the last stage: the result rank sends its result; its peers take it instead of theirs."""
        if parallel_state.layout().rank == self.channel.src:
            self.channel.send(result)
            return result
        return self.receive()

    def receive(self) -> StepResult:
        return self.channel.receive()
