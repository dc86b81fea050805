"""Split-K paged decode (as vLLM's paged_attention_v2): long contexts in partitions.

A decode step has one query token per sequence, so the unsplit kernel runs only
num_seqs x num_kv_heads programs, each walking the whole context: too few to fill
a GPU when contexts are long and batches small. Here the context is cut into
partitions of PARTITION_SIZE keys, one program per (sequence, kv head, partition)
writing its normalised output, row max and row sum; a reduce kernel then merges
a sequence's partitions per query head. Partitions past a sequence's end (or
wholly before its sliding window) exit at once and the reduce never reads them,
so the number launched only has to be an upper bound: the backend derives it
from the block table's width, never from one step's lengths (CUDA-graph safe).
A sequence that fits one partition is copied through unchanged, so its output
is bit-for-bit the unsplit kernel's.
"""
from __future__ import annotations

import triton
import triton.language as tl

from worker.attention.triton_kernels import _attend_rows_state


@triton.jit
def paged_decode_split_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    seq_lens_ptr, query_start_loc_ptr,
    query_stride_t, query_stride_h, block_table_stride, cache_stride_b, cache_stride_o, cache_stride_h,
    scale, sliding_window, block_size, queries_per_kv, head_dim, softcap, num_heads, num_partitions,
    GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """Grid (num_decodes, num_kv_heads, num_partitions). Partials are float32, laid out
    [seq, query head, partition, HEAD_DIM_PAD] (max and sum without the last axis)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    position = seq_len - 1
    key_start = tl.maximum(position - sliding_window + 1, 0)
    part_start = part * PARTITION_SIZE
    part_end = tl.minimum(part_start + PARTITION_SIZE, seq_len)
    if part_start >= seq_len or part_end <= key_start:
        return
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * queries_per_kv + group
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (group[:, None] < queries_per_kv) & (dims[None, :] < head_dim)
    query = tl.load(query_ptr + token * query_stride_t + heads[:, None] * query_stride_h + dims[None, :],
                    mask=mask, other=0.0)
    if not KV_FP8:  # 8-bit caches widen their tiles to the query's dtype instead
        query = query.to(k_cache_ptr.dtype.element_ty)
    positions = tl.zeros([GROUP_PAD], dtype=tl.int32) + position
    out, row_max, row_sum = _attend_rows_state(
        query, positions, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * block_table_stride,
        kv_head, seq_len, tl.maximum(key_start, part_start), part_end, scale, sliding_window, softcap,
        cache_stride_b, cache_stride_o, cache_stride_h, block_size, head_dim,
        GROUP_PAD, HEAD_DIM_PAD, BLOCK_N, UPCAST_DOT, KV_FP8, USE_SOFTCAP)
    rows = (seq.to(tl.int64) * num_heads + heads) * num_partitions + part
    tl.store(part_out_ptr + rows[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=mask)
    head_mask = group < queries_per_kv
    tl.store(part_max_ptr + rows, row_max, mask=head_mask)
    tl.store(part_sum_ptr + rows, row_sum, mask=head_mask)


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_stride_t, out_stride_h, sliding_window, head_dim, out_scale, num_heads, num_partitions,
    HEAD_DIM_PAD: tl.constexpr, PARTITION_SIZE: tl.constexpr,
):
    """Grid (num_decodes, num_heads): merge the partitions a sequence used (those the split
    kernel wrote, found again from its length and window) into one query head's output."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    key_start = tl.maximum(seq_len - sliding_window, 0)
    first = key_start // PARTITION_SIZE
    end = (seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE  # 0 for padding rows (seq_len 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim
    base = (seq.to(tl.int64) * num_heads + head) * num_partitions
    if end - first == 1:  # one partition: its output as it is, as the unsplit kernel's
        out = tl.load(part_out_ptr + (base + first) * HEAD_DIM_PAD + dims, mask=dim_mask, other=0.0)
    else:
        global_max = tl.full([], -1.0e30, tl.float32)
        for part in range(first, end):
            global_max = tl.maximum(global_max, tl.load(part_max_ptr + base + part))
        total = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
        for part in range(first, end):
            weight = tl.exp(tl.load(part_max_ptr + base + part) - global_max) * tl.load(part_sum_ptr + base + part)
            total += weight
            acc += weight * tl.load(part_out_ptr + (base + part) * HEAD_DIM_PAD + dims, mask=dim_mask, other=0.0)
        out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * out_stride_t + head * out_stride_h + dims,
             (out * out_scale).to(out_ptr.dtype.element_ty), mask=dim_mask)
