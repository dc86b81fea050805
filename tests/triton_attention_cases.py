"""Batches for testing paged attention backends against worker/attention/reference.py: the cases
(decodes first, then chunks with cached context; GQA, windows, softcap, 8-bit caches, split-K
partitions) and the batch builder, shared by the Triton interpreter tests
(tests/worker/test_triton_attention.py) and the compiled ones on a GPU (tests/gpu)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention.metadata import AttentionMetadata


@dataclass
class Case:
    """A batch: decodes (query_len 1) first, then (context_len, query_len) chunks."""

    decode_context_lens: tuple[int, ...] = ()
    chunks: tuple[tuple[int, int], ...] = ()
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 4
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype | None = None  # the KV cache's, when not `dtype` (--kv-cache-dtype)
    strided_inputs: bool = False  # q/k/v as column slices of one fused projection
    kv_scales: tuple[float, float] = (1.0, 1.0)  # an 8-bit cache's (k_scale, v_scale)
    softcap: float | None = None  # attention logit soft-capping (Gemma 2)
    partition_size: int = 512  # split-K decode partitions (tiny ones here, so short contexts split)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]


def build_batch(case: Case, generator: torch.Generator) -> Batch:
    """Random q/k/v, a cache already holding each sequence's context, and its metadata.

    Every sequence gets blocks drawn from a shuffled pool, so block ids are
    non-contiguous and out of order; block 0 stays the padding block.
    """
    seqs = [(ctx, 1) for ctx in case.decode_context_lens] + list(case.chunks)
    block_size = case.block_size
    blocks_per_seq = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody uses
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    max_blocks = max(blocks_per_seq) + 1  # one column of padding
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor([pool.pop() for _ in range(count)])

    kvh, dim = case.num_kv_heads, case.head_dim
    cache_shape = (num_blocks, block_size, kvh, dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(case.cache_dtype or case.dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(case.cache_dtype or case.dtype)

    slots, starts = [], [0]
    for seq, (ctx, query_len) in enumerate(seqs):
        for position in range(ctx, ctx + query_len):
            slots.append(int(block_tables[seq, position // block_size]) * block_size + position % block_size)
        starts.append(starts[-1] + query_len)
    num_tokens = starts[-1]
    widths = [case.num_heads * dim, kvh * dim, kvh * dim]
    fused = torch.randn(num_tokens, sum(widths), generator=generator).to(case.dtype)
    query, key, value = (part.view(num_tokens, -1, dim) for part in fused.split(widths, dim=1))
    if not case.strided_inputs:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    seq_lens = [ctx + q for ctx, q in seqs]
    meta = AttentionMetadata(
        num_decodes=len(case.decode_context_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return query, key, value, k_cache, v_cache, meta


CASES = {
    "decode_only": Case(decode_context_lens=(0, 7, 21, 40)),
    "prefill_only": Case(chunks=((0, 9), (0, 23))),
    "mixed_with_context": Case(decode_context_lens=(12, 3), chunks=((6, 5), (0, 11), (13, 19))),
    "mha_block_size_16": Case(decode_context_lens=(30,), chunks=((17, 14),), num_heads=2, num_kv_heads=2,
                              block_size=16),
    "gqa_group_of_3_strided": Case(decode_context_lens=(9,), chunks=((5, 12),), num_heads=6, num_kv_heads=2,
                                   strided_inputs=True),
    "head_dim_24": Case(decode_context_lens=(10,), chunks=((4, 13),), head_dim=24, block_size=3),
    "sliding_window": Case(decode_context_lens=(2, 37), chunks=((21, 18), (0, 9)), sliding_window=5),
    "sliding_window_wider_than_tile": Case(chunks=((9, 30),), decode_context_lens=(44,), sliding_window=20),
    "bfloat16": Case(decode_context_lens=(5, 18), chunks=((7, 10),), dtype=torch.bfloat16),
    "float16_window": Case(decode_context_lens=(25,), chunks=((3, 14),), dtype=torch.float16, sliding_window=7),
    "float32_bfloat16_cache": Case(decode_context_lens=(5, 18), chunks=((7, 10),), cache_dtype=torch.bfloat16),
    "bfloat16_fp8_e4m3_cache": Case(decode_context_lens=(5, 18), chunks=((7, 10),), dtype=torch.bfloat16,
                                    cache_dtype=torch.float8_e4m3fn, kv_scales=(0.05, 0.02)),
    "float32_fp8_e5m2_cache_window": Case(decode_context_lens=(2, 37), chunks=((21, 18),), sliding_window=5,
                                          cache_dtype=torch.float8_e5m2, kv_scales=(2.0, 0.5)),
    "float32_fp8_e4m3_cache_gqa3": Case(decode_context_lens=(9,), chunks=((5, 12),), num_heads=6, num_kv_heads=2,
                                        cache_dtype=torch.float8_e4m3fn, kv_scales=(1.0, 1.0)),
    # Scores of a few units (scale 1.0) capped at 1.5: far from the uncapped output (checked below).
    "softcap": Case(decode_context_lens=(0, 7, 21), chunks=((6, 5), (0, 11), (13, 19)), softcap=1.5),
    "softcap_window_gqa3": Case(decode_context_lens=(2, 37), chunks=((21, 18),), num_heads=6, num_kv_heads=2,
                                sliding_window=5, softcap=1.5),
    "softcap_bfloat16": Case(decode_context_lens=(5, 18), chunks=((7, 10),), dtype=torch.bfloat16, softcap=1.5),
    # Split-K decode: 32-key partitions, contexts ending before, on and after partition bounds.
    "split_decode": Case(decode_context_lens=(0, 30, 31, 32, 63, 100), partition_size=32),
    "split_decode_gqa3_window": Case(decode_context_lens=(5, 50, 90), num_heads=6, num_kv_heads=2,
                                     sliding_window=20, partition_size=32),
    "split_decode_softcap_bfloat16": Case(decode_context_lens=(40, 75), dtype=torch.bfloat16, softcap=1.5,
                                          partition_size=32),
    "split_decode_float16_block_16": Case(decode_context_lens=(64, 65), dtype=torch.float16, block_size=16,
                                          partition_size=32),
    "split_decode_fp8_e4m3_cache": Case(decode_context_lens=(20, 70), dtype=torch.bfloat16,
                                        cache_dtype=torch.float8_e4m3fn, kv_scales=(0.05, 0.02), partition_size=32),
    "split_decode_fp8_e5m2_window": Case(decode_context_lens=(45, 80), sliding_window=33,
                                         cache_dtype=torch.float8_e5m2, kv_scales=(2.0, 0.5), partition_size=32),
    "split_decode_mixed": Case(decode_context_lens=(70, 2), chunks=((6, 5), (40, 9)), partition_size=32),
}
SOFTCAP_SCALE = 1.0  # the softcap cases' score scale: large scores, so that the cap matters
# An 8-bit cache: the reference reads the cache the reference wrote; the interpreter may round the
# new K/V one step differently (see same_cache).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float8_e4m3fn: 0.1,
             torch.float8_e5m2: 0.2}


def same_cache(case: Case, cache: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal; narrowed into a cache of another dtype, within one step of it: GPUs round to nearest
    even (as the reference's Tensor.to), the interpreter truncates."""
    if case.cache_dtype is None:
        return torch.equal(cache, expected)
    if case.cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # sign and magnitude: one step is one code
        codes = cache.view(torch.uint8).int(), expected.view(torch.uint8).int()
        return bool(((codes[0] - codes[1]).abs() <= 1).all())
    step = torch.finfo(case.cache_dtype).eps
    return torch.allclose(cache.float(), expected.float(), rtol=step, atol=0.0)
