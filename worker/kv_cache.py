"""Sizing and allocating the paged KV cache: per layer one K and one V tensor of
shape [num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from common.config import GiB, EngineConfig
from common.errors import ConfigError
from worker.gpu_memory_profile import MemoryProfile, num_blocks_from_profile
from worker.huge_pages import zeros_on_huge_pages

logger = logging.getLogger(__name__)

MIN_BLOCKS = 2  # the null block plus at least one usable block


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


def _kv_shape(hf_config: Any) -> tuple[int, int, int]:
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return hf_config.num_hidden_layers, num_kv_heads, head_dim


def kv_cache_spec(hf_config: Any, block_size: int, dtype: torch.dtype, *, num_layers: int | None = None,
                  num_kv_heads: int | None = None) -> KVCacheSpec:
    """The cache of the whole model, or of the layers and KV heads one rank of a worker group holds."""
    all_layers, all_kv_heads, head_dim = _kv_shape(hf_config)
    return KVCacheSpec(num_layers or all_layers, block_size, num_kv_heads or all_kv_heads, head_dim, dtype)


def num_blocks_for(config: EngineConfig, spec: KVCacheSpec, device: str | torch.device,
                   profile: MemoryProfile | None = None) -> int:
    """How many blocks fit: `num_gpu_blocks_override` if set; on CPU `kv_cache_memory`;
    on CUDA with a memory `profile` (worker.cuda_memory_profiling) what `gpu_memory_utilization`
    leaves after weights, peak activations, other memory and CUDA graphs; on CUDA without one
    (worker groups; call after the model is loaded) the allowed share not already in use."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if profile is not None:
        num_blocks = num_blocks_from_profile(profile, config.gpu_memory_utilization, spec.bytes_per_block, MIN_BLOCKS)
        logger.info("KV cache budget: %d blocks = %.2f GiB of gpu_memory_utilization=%s", num_blocks,
                    num_blocks * spec.bytes_per_block / GiB, config.gpu_memory_utilization)
        return num_blocks
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        source = f"gpu_memory_utilization={config.gpu_memory_utilization}"
    else:
        budget = config.kv_cache_memory
        source = f"kv_cache_memory={config.kv_cache_memory / GiB:.2f} GiB"
    num_blocks = max(budget, 0) // spec.bytes_per_block
    if num_blocks < MIN_BLOCKS:
        raise ConfigError(f"{source} leaves room for {num_blocks} KV cache blocks of "
                          f"{spec.bytes_per_block} bytes; at least {MIN_BLOCKS} are needed")
    return num_blocks


def allocate_kv_caches(hf_config: Any, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: str | torch.device, *, max_model_len: int | None = None,
                       spec: KVCacheSpec | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer. Zero-filled so that the null block and
    never-written slots hold finite values (masked positions multiply them by 0)."""
    spec = spec or kv_cache_spec(hf_config, block_size, dtype)
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(spec.num_layers)]
    tokens_per_request = max_model_len or hf_config.max_position_embeddings
    usable_tokens = (num_blocks - 1) * block_size
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), max concurrency %.2fx at %d tokens per request",
                num_blocks, block_size, num_blocks * spec.bytes_per_block / GiB,
                usable_tokens / tokens_per_request, tokens_per_request)
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    if torch.device(device).type == "cpu":
        return zeros_on_huge_pages(shape, dtype)  # scattered block reads: fewer TLB misses
    return torch.zeros(shape, dtype=dtype, device=device)


def copy_block_prefixes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                        copies: list[tuple[int, int, int]]) -> None:
    """For each (src, dst, n): the first n token slots of block src into block dst, in every
    layer's K and V (a partial prefix hit, `scheduler.partial_block_index`). Run before the
    step writes any KV: src may be handed out again in the same step."""
    for src, dst, num_tokens in copies:
        for k_cache, v_cache in kv_caches:
            k_cache[dst, :num_tokens] = k_cache[src, :num_tokens]
            v_cache[dst, :num_tokens] = v_cache[src, :num_tokens]
