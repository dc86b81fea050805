"""Sizing the KV cache on CUDA from a profiling pass, as vLLM does for --gpu-memory-utilization.

After the weights are loaded the worker runs one dummy step at the largest batch
(max_num_batched_tokens tokens, the logits of up to max_num_seqs rows) and reads the
device's memory counters. The KV cache gets what is left of `total * utilization` after
the weights, the step's peak activations, memory outside torch's allocator (the CUDA
context, other processes) and an estimate for the decode CUDA graphs. `kv_cache_budget`
is the arithmetic alone (unit-tested); `profile_memory` takes the counters from an
injectable `MemoryCounters` (torch.cuda's on a GPU).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import ConfigError

logger = logging.getLogger(__name__)

MiB = 2**20
GRAPH_OVERHEAD_PER_GRAPH = 2 * MiB  # a captured graph's own bookkeeping beyond its pool


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total: int  # the device's memory
    weights: int  # torch's allocations before the step (weights, buffers)
    peak_activations: int  # the step's peak allocation above them
    non_torch: int  # in use but not by torch's allocator: CUDA context, other processes
    cuda_graphs: int = 0  # estimate for the decode graphs' memory pool

    def describe(self) -> str:
        return (f"total {self.total / MiB:.0f} MiB, weights {self.weights / MiB:.0f} MiB, peak activations "
                f"{self.peak_activations / MiB:.0f} MiB, non-torch {self.non_torch / MiB:.0f} MiB, "
                f"CUDA graphs (estimate) {self.cuda_graphs / MiB:.0f} MiB")


def cuda_graph_estimate(peak_activations: int, profiled_tokens: int, max_graph_size: int, num_graphs: int) -> int:
    """The graphs share one pool sized by the largest one's activations: the profiled peak per
    token times its sequences, plus a little per graph. 0 without graphs."""
    if num_graphs == 0 or max_graph_size == 0:
        return 0
    per_token = peak_activations / max(profiled_tokens, 1)
    return int(per_token * min(max_graph_size, profiled_tokens)) + num_graphs * GRAPH_OVERHEAD_PER_GRAPH


def kv_cache_budget(profile: MemoryProfile, utilization: float) -> int:
    """Bytes the KV cache may take: total * utilization less everything else (may be negative)."""
    others = profile.weights + profile.peak_activations + profile.non_torch + profile.cuda_graphs
    return int(profile.total * utilization) - others


def num_blocks_from_profile(profile: MemoryProfile, utilization: float, bytes_per_block: int,
                            min_blocks: int) -> int:
    """KV blocks that fit the budget; a ConfigError naming the numbers when fewer than `min_blocks`."""
    budget = kv_cache_budget(profile, utilization)
    num_blocks = max(budget, 0) // bytes_per_block
    if num_blocks < min_blocks:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} allows {profile.total * utilization / MiB:.0f} MiB, of which "
            f"{profile.describe()} leave {budget / MiB:.0f} MiB: room for {num_blocks} KV cache blocks of "
            f"{bytes_per_block} bytes, at least {min_blocks} needed; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens / --max-num-seqs / --max-cudagraph-batch-size")
    return num_blocks


class MemoryCounters:
    """torch.cuda's counters for one device (tests pass a double)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def free_and_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)


def profile_memory(run_step: Callable[[], Any], counters: MemoryCounters) -> MemoryProfile:
    """Run the dummy step and measure; memory outside torch is read before the step (what the
    process and others hold then, less torch's reserve). The graph estimate is added by the caller."""
    counters.reset()
    weights = counters.allocated()
    free, total = counters.free_and_total()
    non_torch = max((total - free) - counters.reserved(), 0)
    run_step()
    peak_activations = max(counters.peak_allocated() - weights, 0)
    counters.reset()  # the step's activations go back to the device before the cache is allocated
    return MemoryProfile(total=total, weights=weights, peak_activations=peak_activations, non_torch=non_torch)
