"""The other ranks of the offline LLM's worker group, as child processes.

With tensor or pipeline parallelism the LLM's own process is rank 0 (it runs
the scheduler in-process, as with one worker); ranks 1..N-1 are `pagedserve
worker --rank R` processes that follow it over torch.distributed and never
talk to a scheduler. They die with the LLM's process.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from common.cli_args import engine_argv
from common.config import EngineConfig
from pagedserve.process_supervisor import _die_with_parent, free_tcp_port

logger = logging.getLogger(__name__)


class FollowerRanks:
    def __init__(self, config: EngineConfig):
        """Start ranks 1..world_size-1 of `config`'s group; `config` (with the group's meeting
        point filled in) is what rank 0 runs with."""
        if config.distributed_init_method is None:
            config = config.replace(distributed_init_method=f"tcp://127.0.0.1:{free_tcp_port()}")
        self.config = config
        size = config.world_size
        # This process's local rank and the host's ranks: a data-parallel replica's are set by
        # its replica 0 (data_parallel.ReplicaProcesses); else this group is alone on the host.
        base = int(os.environ.setdefault("LOCAL_RANK", "0"))
        host_ranks = os.environ.setdefault("LOCAL_WORLD_SIZE", str(size))
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "worker", *engine_argv(config),
                              "--rank", str(rank)],
                             # Idle between generate calls for as long as the user likes: no timeout
                             # (a dead rank 0 still ends them at once, and so does its exit).
                             env={**os.environ, "LOCAL_RANK": str(base + rank), "LOCAL_WORLD_SIZE": host_ranks,
                                  "PAGEDSERVE_GROUP_TIMEOUT": str(365 * 86400)},
                             preexec_fn=_die_with_parent)
            for rank in range(1, size)]

    def stop(self, timeout_s: float = 10.0) -> None:
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
