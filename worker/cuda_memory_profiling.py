"""The profiling step of a CUDA worker: the largest batch the scheduler may send, run once
before the KV cache exists, to measure its activations (see worker.gpu_memory_profile).

The step is one prefill sequence of max_num_batched_tokens tokens over a one-block
scratch cache (every slot and block-table entry the null block: the step's values do
not matter, only its memory), then the logits of up to max_num_seqs rows in float32.
It runs eager: the compiled step, built later, needs no more than that.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from common.config import EngineConfig
from worker.attention.fp8_kv import is_fp8
from worker.attention.metadata import AttentionMetadata
from worker.compiled_forward import ModelForward
from worker.cuda_graphs import GRAPH_SAFE_BACKENDS, capture_sizes
from worker.gpu_memory_profile import MemoryCounters, MemoryProfile, cuda_graph_estimate, profile_memory
from worker.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)


def profile_step_metadata(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One sequence of `num_tokens` new tokens, all in the null block (slot 0, block 0)."""
    return AttentionMetadata(
        num_decodes=0, slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.zeros((1, -(-num_tokens // block_size)), dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens, query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens])


def run_profile_step(model: Any, lm_head: Any, backend: Any, spec: KVCacheSpec, num_tokens: int,
                     num_logit_rows: int, device: torch.device) -> None:
    """The largest step: the forward over `num_tokens`, then float32 logits of `num_logit_rows` rows."""
    shape = (1, spec.block_size, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
              for _ in model.layers]
    scales = [(1.0, 1.0)] * len(model.layers) if is_fp8(spec.dtype) else None
    forward = ModelForward(model, caches, backend, max_model_len=0, compile=False, kv_scales=scales)
    meta = profile_step_metadata(num_tokens, spec.block_size, device)
    with torch.inference_mode():
        hidden = forward(torch.zeros(num_tokens, dtype=torch.int64, device=device),
                         torch.arange(num_tokens, dtype=torch.int64, device=device), meta)
        if lm_head is not None:
            torch.softmax(lm_head.logits(hidden[:num_logit_rows], upcast=True), dim=-1)  # the sampler's probs


def graphs_apply(config: EngineConfig, world_size: int) -> bool:
    """Whether the worker will capture decode graphs (worker.cuda_graphs.with_decode_graphs)."""
    return (config.resolved_max_cudagraph_batch_size() > 0 and world_size == 1
            and config.resolved_attention_backend() in GRAPH_SAFE_BACKENDS)


def cuda_memory_profile(config: EngineConfig, model: Any, lm_head: Any, backend: Any, spec: KVCacheSpec,
                        device: torch.device, world_size: int,
                        counters: MemoryCounters | None = None) -> MemoryProfile | None:
    """The memory profile that sizes a CUDA worker's KV cache; None where the cache is not sized
    by profiling: a fixed block count, a device other than CUDA, a worker group (whose ranks
    keep the plain free-memory rule)."""
    if config.num_gpu_blocks_override is not None or world_size > 1 or (device.type != "cuda" and counters is None):
        return None
    tokens = config.resolved_max_num_batched_tokens()
    profile = profile_memory(
        lambda: run_profile_step(model, lm_head, backend, spec, tokens, min(config.max_num_seqs, tokens), device),
        counters or MemoryCounters(device))
    sizes = capture_sizes(config.resolved_max_cudagraph_batch_size()) if graphs_apply(config, world_size) else []
    graphs = cuda_graph_estimate(profile.peak_activations, tokens, max(sizes, default=0), len(sizes))
    profile = MemoryProfile(profile.total, profile.weights, profile.peak_activations, profile.non_torch, graphs)
    logger.info("Memory profile at %d tokens: %s", tokens, profile.describe())
    return profile
