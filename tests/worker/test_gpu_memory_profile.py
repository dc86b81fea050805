"""--gpu-memory-utilization sized by a profiling step: the arithmetic, its error, the measuring
order (with counters standing in for torch.cuda's) and the profiling step on a tiny model."""
from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.errors import ConfigError
from worker.cuda_memory_profiling import cuda_memory_profile, graphs_apply, profile_step_metadata
from worker.gpu_memory_profile import (GRAPH_OVERHEAD_PER_GRAPH, MemoryProfile, cuda_graph_estimate, kv_cache_budget,
                                       num_blocks_from_profile, profile_memory)
from worker.kv_cache import KVCacheSpec, num_blocks_for

MiB = 2**20
GiB = 2**30
PROFILE = MemoryProfile(total=80 * GiB, weights=16 * GiB, peak_activations=2 * GiB, non_torch=1 * GiB,
                        cuda_graphs=512 * MiB)


def test_budget_is_the_allowed_share_less_everything_else() -> None:
    assert kv_cache_budget(PROFILE, 0.9) == int(72 * GiB) - (19 * GiB + 512 * MiB)
    assert kv_cache_budget(PROFILE, 0.2) < 0  # 16 GiB allowed, 19.5 in use


def test_blocks_fit_the_budget() -> None:
    per_block = 2 * MiB
    assert num_blocks_from_profile(PROFILE, 0.9, per_block, 2) == (52 * GiB + 512 * MiB) // per_block
    config = EngineConfig(model="m", device="cpu", gpu_memory_utilization=0.9)
    spec = KVCacheSpec(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert spec.bytes_per_block == per_block
    assert num_blocks_for(config, spec, "cpu", PROFILE) == (52 * GiB + 512 * MiB) // per_block
    fixed = EngineConfig(model="m", device="cpu", num_gpu_blocks_override=7)
    assert num_blocks_for(fixed, spec, "cpu", PROFILE) == 7  # a fixed count wins


def test_too_small_a_budget_names_the_numbers() -> None:
    with pytest.raises(ConfigError) as error:
        num_blocks_from_profile(PROFILE, 0.25, 2 * MiB, 300)
    message = str(error.value)
    for part in ("gpu_memory_utilization=0.25 allows 20480 MiB", "weights 16384 MiB", "peak activations 2048 MiB",
                 "non-torch 1024 MiB", "CUDA graphs (estimate) 512 MiB", "leave 512 MiB",
                 "room for 256 KV cache blocks",
                 "at least 300 needed", "raise --gpu-memory-utilization"):
        assert part in message, (part, message)
    with pytest.raises(ConfigError, match="leave -3584 MiB: room for 0 KV cache blocks"):
        num_blocks_from_profile(PROFILE, 0.2, 2 * MiB, 2)


def test_graph_estimate_scales_with_the_largest_graph() -> None:
    assert cuda_graph_estimate(2 * GiB, 2048, 0, 0) == 0
    assert cuda_graph_estimate(2 * GiB, 2048, 256, 35) == 256 * MiB + 35 * GRAPH_OVERHEAD_PER_GRAPH
    assert cuda_graph_estimate(2 * GiB, 128, 256, 35) == 2 * GiB + 35 * GRAPH_OVERHEAD_PER_GRAPH  # capped


class FakeCounters:
    """torch.cuda's counters on a pretend 10 GiB device: 3 GiB of weights, 1 GiB outside torch;
    `allocate` is what the step does."""

    def __init__(self):
        self.allocated_now, self.peak, self.cached = 3 * GiB, 3 * GiB, 3 * GiB + 600 * MiB
        self.events: list[str] = []

    def allocate(self, size: int) -> None:
        self.allocated_now += size
        self.peak = max(self.peak, self.allocated_now)
        self.cached = max(self.cached, self.allocated_now)

    def reset(self) -> None:
        self.events.append("reset")
        self.cached = self.allocated_now  # empty_cache
        self.peak = self.allocated_now

    def allocated(self) -> int:
        return self.allocated_now

    def peak_allocated(self) -> int:
        return self.peak

    def reserved(self) -> int:
        return self.cached

    def free_and_total(self) -> tuple[int, int]:
        return 10 * GiB - (self.cached + 1 * GiB), 10 * GiB


def test_profile_measures_the_steps_peak_above_the_weights() -> None:
    counters = FakeCounters()

    def step() -> None:
        counters.events.append("step")
        counters.allocate(700 * MiB)
        counters.allocate(-700 * MiB)

    profile = profile_memory(step, counters)
    assert profile == MemoryProfile(total=10 * GiB, weights=3 * GiB, peak_activations=700 * MiB, non_torch=1 * GiB)
    assert counters.events == ["reset", "step", "reset"]


def test_profile_step_runs_the_largest_batch_on_a_tiny_model(tiny_hf_model) -> None:
    from worker.attention.torch_backend import TorchAttentionBackend
    from worker.kv_cache import kv_cache_spec
    from worker.lm_head.plain_logits import PlainLogitsLmHead
    from worker.model_loader import load_model

    _, directory = tiny_hf_model("LlamaForCausalLM")
    config = EngineConfig(model=str(directory), dtype="float32", device="cpu", attention_backend="torch",
                          block_size=4, max_num_batched_tokens=40, max_num_seqs=3)
    model, hf_config, _ = load_model(config, "cpu", torch.float32)
    lm_head = PlainLogitsLmHead(model.lm_head)
    spec = kv_cache_spec(hf_config, 4, torch.float32)
    counters = FakeCounters()
    seen: list[tuple[int, int]] = []
    logits = lm_head.logits
    lm_head.logits = lambda hidden, upcast=True: seen.append(tuple(hidden.shape)) or logits(hidden, upcast)
    profile = cuda_memory_profile(config, model, lm_head, TorchAttentionBackend(use_cpu_kernel=False), spec,
                                  torch.device("cpu"), 1, counters=counters)
    assert seen == [(3, 64)]  # the forward over 40 tokens, then max_num_seqs rows of logits
    assert profile.total == 10 * GiB and profile.cuda_graphs == 0  # the torch backend: no graphs
    assert cuda_memory_profile(config, model, lm_head, None, spec, torch.device("cpu"), 2, counters=counters) is None
    assert cuda_memory_profile(config, model, lm_head, None, spec, torch.device("cpu"), 1) is None  # CPU


def test_profile_step_metadata_covers_the_tokens() -> None:
    meta = profile_step_metadata(10, 4, torch.device("cpu"))
    assert meta.block_tables.shape == (1, 3) and meta.slot_mapping.tolist() == [0] * 10
    assert meta.seq_lens_cpu == [10] and meta.num_decodes == 0


def test_graphs_apply_only_where_they_are_captured() -> None:
    triton = dict(model="m", device="cpu", attention_backend="triton")
    assert graphs_apply(EngineConfig(**triton), 1)
    assert not graphs_apply(EngineConfig(**triton), 2)
    assert not graphs_apply(EngineConfig(**triton, enforce_eager=True), 1)
    assert not graphs_apply(EngineConfig(model="m", device="cpu", attention_backend="torch"), 1)
