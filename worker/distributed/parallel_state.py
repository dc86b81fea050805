"""This process's place in its worker group, and the torch.distributed groups it talks over.

A replica's worker group has tensor_parallel_size x pipeline_parallel_size ranks;
global rank = pp_rank * tp_size + tp_rank, so each pipeline stage's ranks are
consecutive (on one host they share a socket's cores). The group meets with
torchrun's conventions: `--distributed-init-method tcp://HOST:PORT` (rank 0's
host), else MASTER_ADDR and MASTER_PORT. gloo on CPU, NCCL on CUDA.

A single worker (world size 1) never initializes torch.distributed: every
helper here then answers for a group of one.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config import EngineConfig
from common.errors import ConfigError

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer that is alive but silent. A dead peer is noticed at
# once (its connection closes); an idle group is kept busy by rank 0's keepalives.
GROUP_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_GROUP_TIMEOUT", "600"))


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank holding this rank's tensor shard in pipeline stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank

    @property
    def result_rank(self) -> int:
        """The rank whose sampled tokens every rank commits: tensor rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size})"


_layout = ParallelLayout()
_tp_group: dist.ProcessGroup | None = None
_tp_shm = None  # ShmAllReduce among this stage's tensor ranks, when they share a host


def tp_shm():
    return _tp_shm


def layout() -> ParallelLayout:
    return _layout


def tp_group() -> dist.ProcessGroup | None:
    return _tp_group


def init_method(config: EngineConfig) -> str:
    if config.distributed_init_method:
        return config.distributed_init_method
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return "env://"
    raise ConfigError("a worker group of several ranks needs --distributed-init-method tcp://HOST:PORT "
                      "(rank 0's host) or MASTER_ADDR and MASTER_PORT in the environment")


def init_worker_group(config: EngineConfig, rank: int, device: torch.device) -> ParallelLayout:
    """Join the replica's worker group (blocking until every rank is there); a no-op for one rank."""
    global _layout, _tp_group
    new = ParallelLayout(rank=rank, tp_size=config.tensor_parallel_size, pp_size=config.pipeline_parallel_size)
    if not 0 <= rank < new.world_size:
        raise ConfigError(f"rank {rank} is outside a group of {new.world_size} "
                          f"(tensor {new.tp_size} x pipeline {new.pp_size})")
    if new.world_size == 1:
        _layout = new
        return new
    backend = "nccl" if device.type == "cuda" else "gloo"
    method = init_method(config)
    logger.info("joining the worker group as %s at %s (%s)", new.describe(), method, backend)
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=new.world_size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    # Every rank creates every subgroup, in the same order (torch.distributed's rule).
    for stage in range(new.pp_size):
        ranks = list(range(stage * new.tp_size, (stage + 1) * new.tp_size))
        group = dist.new_group(ranks) if new.tp_size > 1 else None
        if stage == new.pp_rank:
            _tp_group = group
            stage_ranks = ranks
    _layout = new
    if new.tp_size > 1 and device.type == "cpu" and os.environ.get("PAGEDSERVE_TP_SHM", "1") != "0" \
            and _same_host(_tp_group):
        global _tp_shm
        from worker.distributed.shm_all_reduce import ShmAllReduce
        _tp_shm = ShmAllReduce(_tp_group, stage_ranks, new.tp_rank)
        logger.info("tensor-parallel all-reduce through shared memory (the stage's ranks share this host)")
    logger.info("worker group complete: %d ranks", new.world_size)
    return new


def _same_host(group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of `group` runs on this host, in this network namespace."""
    identity = f"{socket.gethostname()}/{os.stat('/proc/self/ns/net').st_ino if os.path.exists('/proc/self/ns/net') else ''}"
    mine = torch.tensor([zlib.crc32(identity.encode())], dtype=torch.int64)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return bool(low == high)


def group_minimum(value: int) -> int:
    """The smallest `value` over the whole group (every rank calls it); `value` for one rank."""
    if _layout.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def close_worker_group() -> None:
    global _layout, _tp_group
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group: nothing left to tidy
            pass
    global _tp_shm
    if _tp_shm is not None:
        _tp_shm.close()
    _layout, _tp_group, _tp_shm = ParallelLayout(), None, None
