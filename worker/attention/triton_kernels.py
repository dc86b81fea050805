"""Triton kernels for paged attention: cache write, decode, prefill/extend.

Imported lazily by `triton_backend` (this module imports triton at top level).
Whether kernels run compiled or in the CPU interpreter is fixed when this
module is imported (triton reads TRITON_INTERPRET at `@triton.jit` time).

Key/value positions are walked in tiles of BLOCK_N tokens; each token finds
its cache slot through the block table, so the cache block size need not be a
power of two nor match BLOCK_N. Query heads that share a kv head are packed as
rows of one tile (GQA), so every K/V tile is loaded once per kv head.
`sliding_window` is always applied: callers pass NO_WINDOW when there is none.
An 8-bit float cache (KV_FP8) holds K / k_scale and V / v_scale: writes divide,
saturate and round; reads widen the tiles to the query's dtype, the K scale
folded into `scale` and the V scale into `out_scale`. With USE_SOFTCAP the scores are
soft-capped, tanh(s / softcap) * softcap, before the mask (Gemma 2's attention logits).
"""
from __future__ import annotations

import triton
import triton.language as tl

# The interpreter multiplies bfloat16 dot operands as raw uint16 bits, so
# interpreted kernels upcast dot inputs to float32 (compiled ones never do).
RUNS_INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
NO_WINDOW = 1 << 30  # larger than any sequence, still far from int32 overflow


@triton.jit
def _fp8_bits(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The 8-bit float code of float32 x (already within the format's finite range; NaN: 0x7F
    with x's sign), rounded to nearest even: integer rounding of the bits, which the CPU
    interpreter does exactly (its float8 casts mishandle a rounding carry into the exponent)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANTISSA
    odd = (magnitude >> shift) & 1
    normal = ((magnitude + ((1 << (shift - 1)) - 1) + odd) >> shift) - ((127 - BIAS) << MANTISSA)
    # Below the smallest normal: units of the smallest subnormal, rounded to an even integer by
    # adding and subtracting 2^23 (a carry to 2^MANTISSA is the smallest normal's code).
    units = tl.where(x != x, 0.0, tl.abs(x)) * (2.0 ** (BIAS - 1 + MANTISSA))
    subnormal = ((units + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(magnitude < ((128 - BIAS) << 23), subnormal, normal)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    cache_stride_b, cache_stride_o, cache_stride_h,
    block_size, num_kv_heads, head_dim, k_scale, v_scale,
    KV_HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr,
):
    """One program per new token: copy its K and V (all kv heads) into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token without a slot
        return
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    cache_offsets = ((slot // block_size) * cache_stride_b + (slot % block_size) * cache_stride_o
                     + heads[:, None] * cache_stride_h + dims[None, :])
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
                    mask=mask)
    if KV_FP8:  # divided by the scale, saturated (NaN stays NaN), rounded to nearest even
        key = _fp8_bits(tl.clamp(key.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL),
                        FP8_MANTISSA, FP8_BIAS).to(k_cache_ptr.dtype.element_ty, bitcast=True)
        value = _fp8_bits(tl.clamp(value.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX,
                                   propagate_nan=tl.PropagateNan.ALL),
                          FP8_MANTISSA, FP8_BIAS).to(v_cache_ptr.dtype.element_ty, bitcast=True)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee" keeps float32 exact on GPUs (no TF32); 16-bit inputs ignore it.
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tanh(x):
    """tanh in float32 from exp (triton.language has none): +-1 at the extremes, no NaN."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_rows_state(
    query, positions, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
    seq_len, key_start, key_end, scale, sliding_window, softcap,
    cache_stride_b, cache_stride_o, cache_stride_h, block_size, head_dim,
    ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """Online-softmax attention of `query` rows [ROWS, HEAD_DIM_PAD] at `positions`
    over cached keys in [key_start, key_end); returns (output normalised by its row sums,
    row max, row sum), float32 (8-bit caches: before the V scale). Keys of a tile past
    key_end are only masked by causality and seq_len: callers end ranges on tile bounds
    or at a causal limit."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim
    # A finite start value keeps exp(m_old - m_new) defined for rows that see
    # no key in a tile (fully masked rows would otherwise give inf - inf).
    row_max = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    first_tile = (key_start // BLOCK_N) * BLOCK_N
    for tile in range(first_tile, key_end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_mask = keys < seq_len
        block_ids = tl.load(block_table_row_ptr + keys // block_size, mask=key_mask, other=0).to(tl.int64)
        key_offsets = block_ids * cache_stride_b + (keys % block_size) * cache_stride_o + kv_head * cache_stride_h
        load_mask = key_mask[:, None] & dim_mask[None, :]
        k_tile = tl.load(k_cache_ptr + key_offsets[:, None] + dims[None, :], mask=load_mask, other=0.0)
        if KV_FP8:
            k_tile = k_tile.to(query.dtype)
        scores = _dot(query, tl.trans(k_tile), UPCAST_DOT) * scale
        if USE_SOFTCAP:
            scores = _tanh(scores / softcap) * softcap
        visible = ((keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - sliding_window)
                   & key_mask[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v_tile = tl.load(v_cache_ptr + key_offsets[:, None] + dims[None, :], mask=load_mask, other=0.0)
        if KV_FP8:
            v_tile = v_tile.to(query.dtype)
        acc = acc * rescale[:, None] + _dot(probs.to(v_tile.dtype), v_tile, UPCAST_DOT)
        row_max = new_max
    row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)  # padding rows only
    return acc / row_sum[:, None], row_max, row_sum


@triton.jit
def _attend_rows(
    query, positions, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
    seq_len, key_start, key_end, scale, sliding_window, softcap,
    cache_stride_b, cache_stride_o, cache_stride_h, block_size, head_dim,
    ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """_attend_rows_state's normalised output alone."""
    out, _, _ = _attend_rows_state(
        query, positions, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
        seq_len, key_start, key_end, scale, sliding_window, softcap,
        cache_stride_b, cache_stride_o, cache_stride_h, block_size, head_dim,
        ROWS, HEAD_DIM_PAD, BLOCK_N, UPCAST_DOT, KV_FP8, USE_SOFTCAP)
    return out


@triton.jit
def paged_decode_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    query_stride_t, query_stride_h, out_stride_t, out_stride_h, block_table_stride,
    cache_stride_b, cache_stride_o, cache_stride_h,
    scale, sliding_window, block_size, queries_per_kv, head_dim, out_scale, softcap,
    GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """Grid (num_decodes, num_kv_heads): the one query token of a decode
    sequence, all query heads of one kv head as rows."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    position = seq_len - 1

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * queries_per_kv + group
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (group[:, None] < queries_per_kv) & (dims[None, :] < head_dim)
    query = tl.load(query_ptr + token * query_stride_t + heads[:, None] * query_stride_h + dims[None, :],
                    mask=mask, other=0.0)
    if not KV_FP8:  # 8-bit caches widen their tiles to the query's dtype instead
        query = query.to(k_cache_ptr.dtype.element_ty)
    positions = tl.zeros([GROUP_PAD], dtype=tl.int32) + position
    key_start = tl.maximum(position - sliding_window + 1, 0)
    out = _attend_rows(
        query, positions, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * block_table_stride,
        kv_head, seq_len, key_start, seq_len, scale, sliding_window, softcap,
        cache_stride_b, cache_stride_o, cache_stride_h, block_size, head_dim,
        GROUP_PAD, HEAD_DIM_PAD, BLOCK_N, UPCAST_DOT, KV_FP8, USE_SOFTCAP) * out_scale
    tl.store(out_ptr + token * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def paged_prefill_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    query_stride_t, query_stride_h, out_stride_t, out_stride_h, block_table_stride,
    cache_stride_b, cache_stride_o, cache_stride_h,
    scale, sliding_window, block_size, queries_per_kv, head_dim, first_seq, out_scale, softcap,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """Grid (num_prefills, num_kv_heads, query tiles): BLOCK_Q query tokens of a
    chunk times the query heads of one kv head form the BLOCK_M rows of a tile.
    The chunk's tokens follow `seq_len - query_len` cached context tokens."""
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_index = q_tile * BLOCK_Q + rows // queries_per_kv  # token within the chunk
    heads = kv_head * queries_per_kv + rows % queries_per_kv
    row_mask = (rows < BLOCK_Q * queries_per_kv) & (query_index < query_len)
    tokens = (query_start + query_index).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = row_mask[:, None] & (dims[None, :] < head_dim)
    query = tl.load(query_ptr + tokens[:, None] * query_stride_t + heads[:, None] * query_stride_h + dims[None, :],
                    mask=mask, other=0.0)
    if not KV_FP8:  # 8-bit caches widen their tiles to the query's dtype instead
        query = query.to(k_cache_ptr.dtype.element_ty)
    positions = context_len + query_index

    first_position = context_len + q_tile * BLOCK_Q
    key_end = tl.minimum(seq_len, first_position + BLOCK_Q)  # causal: nothing past the tile's last query
    key_start = tl.maximum(first_position - sliding_window + 1, 0)
    out = _attend_rows(
        query, positions, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * block_table_stride,
        kv_head, seq_len, key_start, key_end, scale, sliding_window, softcap,
        cache_stride_b, cache_stride_o, cache_stride_h, block_size, head_dim,
        BLOCK_M, HEAD_DIM_PAD, BLOCK_N, UPCAST_DOT, KV_FP8, USE_SOFTCAP) * out_scale
    tl.store(out_ptr + tokens[:, None] * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
