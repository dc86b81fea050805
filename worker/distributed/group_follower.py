"""The loop of every rank but 0 in a worker group: do what rank 0 hands over.

Rank 0 alone talks to the scheduler; it broadcasts each step plan, and while
idle a keepalive, to the other ranks (GroupChannel). A follower executes each
plan exactly as rank 0 does (the same inputs, so the same collectives in the
same order), and returns when rank 0 stops the group. A rank that dies breaks
the others' next collective: they raise, and the whole group restarts.
"""
from __future__ import annotations

import logging
from typing import Any

from common.protocol import GroupControl, MessageType, StepPlan
from worker.distributed.group_channel import GroupChannel

logger = logging.getLogger(__name__)


def follow(worker: Any) -> str:
    """Run rank 0's plans until it stops the group; returns why it stopped."""
    channel = GroupChannel(0, (MessageType.STEP_PLAN, MessageType.GROUP_CONTROL))
    logger.info("following rank 0 of the worker group")
    while True:
        msg = channel.receive()
        if isinstance(msg, StepPlan):
            worker.execute(msg)
        elif isinstance(msg, GroupControl):
            if msg.action == "reset":
                worker.reset_requests()
            elif msg.action == "stop":
                return "rank 0 stopped the group"
