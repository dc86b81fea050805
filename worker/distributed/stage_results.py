"""A pipeline step's outcome, from the last stage to every other rank.

Only the last stage computes logits; the other stages still keep every
request's tokens (their next step's inputs) and rank 0 answers the scheduler.
The result rank (tensor rank 0 of the last stage) broadcasts the sampled
tokens and logprobs as a StepResult's wire encoding; every rank, the result
rank included, then commits exactly those tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.protocol import MessageType, StepResult
from worker.distributed import parallel_state
from worker.distributed.group_channel import GroupChannel

if TYPE_CHECKING:
    from worker.model_runner import RunnerOutput


class StageResults:
    def __init__(self) -> None:
        self.channel = GroupChannel(parallel_state.layout().result_rank, (MessageType.STEP_RESULT,))

    def share(self, output: "RunnerOutput") -> "RunnerOutput":
        """On the last stage: the result rank sends its output; its peers take it instead of theirs."""
        if parallel_state.layout().rank == self.channel.src:
            self.channel.send(StepResult(step_id=0, request_ids=output.request_ids,
                                         sampled_token_ids=output.sampled_token_ids,
                                         sampled_logprobs=output.sampled_logprobs,
                                         prompt_logprobs=output.prompt_logprobs))
            return output
        return self.receive()

    def receive(self) -> "RunnerOutput":
        from worker.model_runner import RunnerOutput
        result = self.channel.receive()
        return RunnerOutput(list(result.request_ids), list(result.sampled_token_ids), dict(result.sampled_logprobs),
                            dict(result.prompt_logprobs))
