"""Rank 0's side of a worker group: hand each plan to the other ranks, then run it too.

Used by the worker process (WorkerService) and by the offline LLM, whose rank 0
runs in the user's process. For a worker alone (world size 1) it only runs the plan.
"""
from __future__ import annotations

from typing import Any

from common.protocol import GroupControl, MessageType, StepPlan, StepResult


class GroupLeader:
    def __init__(self, worker: Any):
        """`worker`: a worker.worker.Worker (not imported here: the worker module imports this package)."""
        self.worker = worker
        self.channel = None
        layout = getattr(worker, "layout", None)  # (test doubles of the worker have none)
        if layout is not None and layout.world_size > 1:
            from worker.distributed.group_channel import GroupChannel
            self.channel = GroupChannel(0, (MessageType.STEP_PLAN, MessageType.GROUP_CONTROL))

    @property
    def is_group(self) -> bool:
        return self.channel is not None

    def execute(self, plan: StepPlan) -> StepResult:
        if self.channel is not None:
            self.channel.send(plan)
        return self.worker.execute(plan)

    def reset_requests(self) -> None:
        self.worker.reset_requests()
        self.tell("reset")

    def tell(self, action: str) -> None:
        """`keepalive`, `reset` or `stop` to the other ranks (see GroupControl)."""
        if self.channel is None:
            return
        try:
            self.channel.send(GroupControl(action=action))
        except RuntimeError:
            if action != "stop":
                raise  # a broken group: the caller exits and the group restarts
            # stopping anyway: the other ranks are gone already
