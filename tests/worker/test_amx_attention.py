"""The AMX tile attention kernel (worker/csrc/amx_attention.h) against the loop-by-loop reference:
prefill and extend chunks of several sequences at once, and decodes several to a tile, over
shuffled paged blocks of bfloat16 or 8-bit float (e4m3, e5m2, scales other than 1) caches. Runs only
where the CPU has AMX-BF16 (elsewhere the kernel is not built and the tests skip); the
shared-prefix decode kernel's bfloat16 tests cover its AMX path on such CPUs too."""
from __future__ import annotations

import pytest
import torch

from worker.attention.fp8_kv import to_cache
from worker.attention.reference import reference_attention
from worker.kernels import cpu_ops


@pytest.fixture(autouse=True)
def _amx():
    if not cpu_ops.amx_attention_available():
        pytest.skip("no AMX-BF16 tiles here (or the kernels are not built)")


def _batch(decodes, chunks, block_size, heads, kv_heads, dim, make_metadata, make_block_tables, seed=0,
           query_scale=1.0, rising=False, cache_dtype=torch.bfloat16, scales=(1.0, 1.0)):
    g = torch.Generator().manual_seed(seed)
    contexts = list(decodes) + [c for c, _ in chunks]
    query_lens = [1] * len(decodes) + [q for _, q in chunks]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    tables = make_block_tables(seq_lens, block_size, num_blocks, g)
    meta = make_metadata(contexts, query_lens, tables, block_size, len(decodes))
    tokens = sum(query_lens)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache, v_cache = (to_cache(torch.randn(shape, generator=g), cache_dtype, s) for s in scales)
    query = (torch.randn(tokens, heads, dim, generator=g) * query_scale).bfloat16()
    key = torch.randn(tokens, kv_heads, dim, generator=g).bfloat16()
    value = torch.randn(tokens, kv_heads, dim, generator=g).bfloat16()
    if rising:  # every query one direction, keys along it growing with position: the max climbs
        direction = torch.randn(dim, generator=g)
        query = direction.expand(tokens, heads, dim).bfloat16()
        key = (direction * torch.arange(tokens).view(-1, 1, 1) / 8).expand(tokens, kv_heads, dim).bfloat16()
    expected = reference_attention(query, key, value, k_cache, v_cache, meta, scale=dim ** -0.5,
                                   sliding_window=None, k_scale=scales[0], v_scale=scales[1])  # also writes K/V
    return meta, query, k_cache, v_cache, expected


SHAPES = {"smollm2": (9, 3, 64), "mha_32": (4, 4, 32), "gqa_8": (8, 1, 64), "dim_128": (8, 2, 128)}
# Fresh prompts, extends whose context ends mid-block, chunks shorter than a row tile, one query.
CHUNKS = ((0, 40), (37, 19), (100, 5), (16, 33), (0, 1), (250, 70))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunks_match_the_reference(shape, block_size, threads, make_metadata, make_block_tables) -> None:
    heads, kv_heads, dim = SHAPES[shape]
    meta, query, k_cache, v_cache, expected = _batch((12, 3), CHUNKS, block_size, heads, kv_heads, dim,
                                                     make_metadata, make_block_tables)
    chosen = [2, 3, 5, 7]  # the decodes and two chunks are left to other kernels
    out = torch.full_like(query, float("nan"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_ops.amx_prefill_attention(out, query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                      meta.seq_lens, torch.tensor(chosen, dtype=torch.int32), dim ** -0.5)
    finally:
        torch.set_num_threads(previous)
    starts = meta.query_start_loc_cpu
    rows = [t for s in chosen for t in range(starts[s], starts[s + 1])]
    others = [t for t in range(query.shape[0]) if t not in rows]
    assert torch.isnan(out[others]).all()
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), atol=2e-2, rtol=2e-2)


# Decodes of lengths around the 16- and 32-key steps, one of a single position, and long ones.
DECODES = (0, 14, 15, 16, 31, 32, 47, 200, 5, 64, 100, 129, 3)
CACHES = {"bf16": (torch.bfloat16, (1.0, 1.0)), "e4m3": (torch.float8_e4m3fn, (0.3, 1.7)),
          "e5m2": (torch.float8_e5m2, (2.5, 0.6))}


@pytest.mark.parametrize("block_size,with_chunks", [(16, False), (32, False), (64, False), (32, True)],
                         ids=["decodes_16", "decodes_32", "decodes_64", "mixed_32"])
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decodes_and_fp8_caches_match_the_reference(shape, cache, block_size, with_chunks, make_metadata,
                                                    make_block_tables) -> None:
    """Every sequence of a batch to the kernel: decodes go 16 / gq to a tile (partly filled tiles,
    members of different lengths), chunks by rows; 8-bit caches widen K and V to bfloat16."""
    heads, kv_heads, dim = SHAPES[shape]
    cache_dtype, scales = CACHES[cache]
    chunks = CHUNKS if with_chunks else ()
    meta, query, k_cache, v_cache, expected = _batch(DECODES, chunks, block_size, heads, kv_heads, dim,
                                                     make_metadata, make_block_tables, seed=1,
                                                     cache_dtype=cache_dtype, scales=scales)
    out = torch.full_like(query, float("nan"))
    cpu_ops.amx_prefill_attention(out, query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                  meta.seq_lens, torch.arange(meta.num_seqs, dtype=torch.int32), dim ** -0.5,
                                  *scales)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_scores_far_apart_stay_finite(make_metadata, make_block_tables) -> None:
    """Large scores (probabilities near 0 and 1 side by side) must not overflow the softmax."""
    meta, query, k_cache, v_cache, expected = _batch((), ((30, 50),), 16, 2, 1, 32, make_metadata,
                                                     make_block_tables, query_scale=40.0)
    out = torch.empty_like(query)
    cpu_ops.amx_prefill_attention(out, query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                  meta.seq_lens, torch.tensor([0], dtype=torch.int32), 32 ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_a_running_max_that_keeps_rising_is_rescaled(make_metadata, make_block_tables) -> None:
    """Scores that climb with the position move each row's max past the kernel's slack again and
    again (the sum and the accumulator on the tiles are rescaled each time); the rows still see
    the reference's weights, which put nearly everything on their last positions."""
    meta, query, k_cache, v_cache, expected = _batch((), ((0, 300),), 32, 9, 3, 64, make_metadata,
                                                     make_block_tables, rising=True)
    out = torch.empty_like(query)
    cpu_ops.amx_prefill_attention(out, query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                  meta.seq_lens, torch.tensor([0], dtype=torch.int32), 64 ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_bad_arguments_are_refused(make_metadata, make_block_tables) -> None:
    meta, query, k_cache, v_cache, _ = _batch((), ((0, 20),), 16, 2, 1, 32, make_metadata, make_block_tables)
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens)
    seqs = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="and 1 unless"):
        cpu_ops.amx_prefill_attention(torch.empty_like(query), query, k_cache, v_cache, *args, seqs, 1.0, 2.0)
    with pytest.raises(RuntimeError, match="8-bit floats"):
        cpu_ops.amx_prefill_attention(torch.empty_like(query), query, k_cache.half(), v_cache.half(), *args, seqs,
                                      1.0)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        cpu_ops.amx_prefill_attention(query.float(), query.float(), k_cache, v_cache, *args, seqs, 1.0)
    with pytest.raises(RuntimeError, match="block_size % 16"):
        cpu_ops.amx_prefill_attention(torch.empty_like(query), query, k_cache.view(-1, 8, 1, 32),
                                      v_cache.view(-1, 8, 1, 32), *args, seqs, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.amx_prefill_attention(torch.empty_like(query), query, k_cache, v_cache, *args,
                                      torch.tensor([1], dtype=torch.int32), 1.0)
