"""The Python entry points of the CPU kernel extension (built by `cpu_extension`): paged
attention, the K/V cache write, the greedy near-tie scan, random sampling, sampled tokens'
logprobs, the rotary embedding and the packed matmuls' availability.

Every function but `load` and `packed_linear_available` requires `load()` to have
succeeded; callers check it once and keep their PyTorch fallback otherwise.
"""
from __future__ import annotations

import torch

from worker.kernels import cpu_extension
from worker.kernels.cpu_extension import load

__all__ = ["load", "packed_linear_available", "amx_bf16_available", "paged_attention", "shared_prefix_attention",
           "amx_attention_available", "amx_prefill_attention",
           "shared_prefix_attention_available", "write_kv_cache", "near_top_scan",
           "sample_random_rows", "token_logprobs_rows", "rotary_qk"]


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether the extension is built and this CPU runs its packed matmul in `dtype`:
    bfloat16 needs AVX512-BF16, float32 AVX-512."""
    module = load()
    if module is None:
        return False
    if dtype == torch.bfloat16:
        return bool(module.bf16_linear_available())
    return dtype == torch.float32 and bool(module.f32_linear_available())


def amx_bf16_available() -> bool:
    """Whether this CPU has AMX-BF16 tiles, which PyTorch's own bfloat16 matmuls (oneDNN) use:
    there they beat the packed kernels and the paged attention kernel on many rows (prefill
    chunks, large batches), while one or a few rows still go faster through the kernels."""
    return {"amx_bf16", "amx_tile"} <= cpu_extension.cpu_flags()


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, sliding_window: int | None, *, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """Fill `out` [T, H, D] with attention over the paged cache for every sequence of the batch.
    All tensors on CPU, int32 metadata (see worker/csrc/paged_attention.cpp); k_scale/v_scale: an
    8-bit cache's per-tensor scales."""
    cpu_extension._module.paged_attention(out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                          float(scale), int(sliding_window or 0), float(k_scale), float(v_scale))


def shared_prefix_attention_available() -> bool:
    """Whether the extension is built with the shared-prefix decode attention (AVX-512)."""
    module = load()
    return module is not None and bool(module.shared_prefix_attention_available())


def shared_prefix_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            group_start: torch.Tensor, members: torch.Tensor, prefix_lens: torch.Tensor,
                            scale: float) -> None:
    """Fill the rows of `out` of the grouped decodes, `members[group_start[g]:group_start[g + 1]]`
    (sequence indices) sharing their first `prefix_lens[g]` positions' blocks; other rows are left
    as they are. int32 metadata (see worker/csrc/shared_prefix_attention.cpp)."""
    cpu_extension._module.shared_prefix_attention(out, query, k_cache, v_cache, block_tables, query_start_loc,
                                                  seq_lens, group_start, members, prefix_lens, float(scale))


def amx_attention_available() -> bool:
    """Whether the extension runs attention on AMX tiles here (built for a CPU with AMX-BF16 and
    permitted by the kernel)."""
    module = load()
    return module is not None and bool(module.amx_attention_available())


def amx_prefill_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          seqs: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Fill the rows of `out` of the sequences `seqs` (int32 indices into the batch) with causal
    attention over the paged cache, on AMX tiles: bfloat16 queries, bfloat16 or 8-bit float caches
    (k_scale/v_scale: their scales), head_dim a multiple of 32, blocks a multiple of 16 tokens;
    decodes go several to a tile (see worker/csrc/amx_prefill_attention.cpp)."""
    cpu_extension._module.amx_prefill_attention(out, query, k_cache, v_cache, block_tables, query_start_loc,
                                                seq_lens, seqs, float(scale), float(k_scale), float(v_scale))


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Copy the new tokens' K/V [T, KVH, D] (rows contiguous; the caches' dtype, float32 rounded
    into bfloat16 caches, or any of float32/bfloat16/float16 divided by k_scale/v_scale into 8-bit
    float caches) into their slots of the [blocks, block_size, KVH, D] caches."""
    cpu_extension._module.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale))


def near_top_scan(logits: torch.Tensor, model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`worker.lm_head.near_tie_rescore.near_top_scan` for contiguous float32/bfloat16 CPU logits
    [N, vocab]: (argmax [N], near-top counts [N])."""
    info = torch.finfo(model_dtype)
    argmax, counts = cpu_extension._module.near_top_scan(logits, float(info.eps), float(info.tiny))
    return argmax, counts


def sample_random_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`worker.random_race.sample_random_rows_reference` for contiguous float32/bfloat16 CPU
    logits [R, vocab]; every parameter a contiguous [R] column (top_k int64, 0: off; top_p
    float32, 1: off; min_p float32, 0: off; keys int64)."""
    return cpu_extension._module.sample_random_rows(logits, temperature, top_k, top_p, min_p, keys)


def token_logprobs_rows(logits: torch.Tensor, chosen: torch.Tensor,
                        num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For contiguous float32/bfloat16 CPU logits [R, vocab] and chosen ids [R] (int64):
    the chosen logprobs [R], their ranks [R], and the `num_top` largest logprobs [R, num_top]
    with their ids (see worker/csrc/token_logprobs.cpp)."""
    chosen_logprobs, ranks, top_logprobs, top_ids = cpu_extension._module.token_logprobs_rows(
        logits, chosen, int(num_top))
    return chosen_logprobs, ranks, top_logprobs, top_ids


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
              kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D] and k [T, kv_heads, D], rotated and contiguous, from a fused bf16 qkv
    projection [T, >= (heads + kv_heads) * D] (q's heads first, then k's) and cos/sin [T, D]:
    bit for bit `worker.models.rotary.apply_rotary` in eager bf16 (see worker/csrc/rotary.cpp)."""
    return torch.ops.pagedserve.rotary_qk(qkv, cos, sin, heads, kv_heads)
