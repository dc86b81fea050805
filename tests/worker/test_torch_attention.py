"""TorchAttentionBackend against the loop-by-loop reference, on paged caches with shuffled blocks."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from worker.attention import get_attention_backend
from worker.attention.reference import reference_attention
from worker.attention.torch_backend import MIN_BUCKET_SEQS, TorchAttentionBackend, bucket_by_length


@dataclass(frozen=True)
class Case:
    """Decodes (query length 1, given by their context length) first, then (context, query) chunks."""

    decode_contexts: tuple[int, ...] = ()
    chunks: tuple[tuple[int, int], ...] = ()
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 4
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype | None = None  # the KV cache's, when not `dtype` (--kv-cache-dtype)
    softcap: float | None = None  # attention logit soft-capping (Gemma 2)
    scale: float | None = None  # the scores' scale; None: head_dim ** -0.5


def run_case(case: Case, make_metadata, make_block_tables, seed: int = 0,
             backend: TorchAttentionBackend | None = None):
    """(backend output, reference output, backend caches, reference caches)."""
    g = torch.Generator().manual_seed(seed)
    contexts = list(case.decode_contexts) + [c for c, _ in case.chunks]
    query_lens = [1] * len(case.decode_contexts) + [q for _, q in case.chunks]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    num_blocks = sum(-(-n // case.block_size) for n in seq_lens) + 4
    tables = make_block_tables(seq_lens, case.block_size, num_blocks, g)
    meta = make_metadata(contexts, query_lens, tables, case.block_size, len(case.decode_contexts))

    tokens = sum(query_lens)
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    cache_dtype = case.cache_dtype or case.dtype
    k_cache = torch.randn(cache_shape, generator=g).to(cache_dtype)  # random "context" and stale slots
    v_cache = torch.randn(cache_shape, generator=g).to(cache_dtype)
    query = torch.randn(tokens, case.num_heads, case.head_dim, generator=g).to(case.dtype)
    # key/value as column slices of one fused projection, the way the model passes them
    fused = torch.randn(tokens, 2 * case.num_kv_heads * case.head_dim, generator=g).to(case.dtype)
    key, value = (t.view(tokens, case.num_kv_heads, case.head_dim) for t in fused.chunk(2, dim=-1))
    scale = case.scale or case.head_dim ** -0.5

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    capped = {} if case.softcap is None else {"softcap": case.softcap}
    expected = reference_attention(query, key, value, ref_k, ref_v, meta,
                                   scale=scale, sliding_window=case.sliding_window, **capped)
    actual = (backend or TorchAttentionBackend()).forward(query, key, value, k_cache, v_cache, meta,
                                             scale=scale, sliding_window=case.sliding_window, **capped)
    return actual, expected, (k_cache, v_cache), (ref_k, ref_v)


CASES = {
    "mixed": Case(decode_contexts=(5, 17, 0, 8), chunks=((0, 7), (9, 5), (3, 13), (16, 1))),
    "only_decodes": Case(decode_contexts=(1, 4, 33, 12, 7)),
    "only_prefills": Case(chunks=((0, 11), (0, 1), (0, 20))),
    "only_extends": Case(chunks=((6, 3), (21, 10))),
    "mha": Case(decode_contexts=(3, 9), chunks=((4, 6),), num_heads=4, num_kv_heads=4),
    "mqa": Case(decode_contexts=(3, 9), chunks=((4, 6),), num_heads=8, num_kv_heads=1),
    "block_size_1": Case(decode_contexts=(3, 9), chunks=((4, 6),), block_size=1),
    "block_size_16_dim_64": Case(decode_contexts=(30, 2), chunks=((17, 20),), block_size=16, head_dim=64),
    # prefills over more keys than the CPU kernel scores at once (48), in several row groups
    "long_prefills": Case(chunks=((40, 70), (0, 100), (3, 49)), num_heads=6, num_kv_heads=2, head_dim=32,
                          block_size=16),
    "long_prefills_window": Case(chunks=((40, 70), (0, 100)), num_heads=6, num_kv_heads=2, head_dim=32,
                                 block_size=16, sliding_window=30),
    "window_3": Case(decode_contexts=(2, 10, 25), chunks=((0, 9), (7, 6), (20, 4)), sliding_window=3),
    "window_8": Case(decode_contexts=(5, 8, 40), chunks=((0, 20), (13, 9)), sliding_window=8),
    "window_1": Case(decode_contexts=(6,), chunks=((0, 5), (4, 3)), sliding_window=1),
    "window_larger_than_seqs": Case(decode_contexts=(6,), chunks=((0, 5), (4, 3)), sliding_window=64),
    # enough decodes of spread-out lengths to be split into several length buckets
    "many_decodes": Case(decode_contexts=tuple((i * 37) % 90 for i in range(40)), chunks=((5, 4),)),
    "many_decodes_window": Case(decode_contexts=tuple((i * 37) % 90 for i in range(40)), sliding_window=20),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_float32(name: str, make_metadata, make_block_tables) -> None:
    actual, expected, caches, ref_caches = run_case(CASES[name], make_metadata, make_block_tables)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)
    for cache, ref_cache in zip(caches, ref_caches):
        assert torch.equal(cache, ref_cache)  # same slots written, nothing else touched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["mixed", "window_3"])
def test_matches_reference_half_precision(name: str, dtype: torch.dtype, make_metadata,
                                         make_block_tables) -> None:
    case = Case(**{**CASES[name].__dict__, "dtype": dtype})
    actual, expected, caches, ref_caches = run_case(case, make_metadata, make_block_tables)
    assert actual.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)
    for cache, ref_cache in zip(caches, ref_caches):
        assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("name", list(CASES))
def test_bfloat16_cache_under_float32_queries(name: str, make_metadata, make_block_tables) -> None:
    """--kv-cache-dtype bfloat16 on a float32 model: the new K/V rounded to nearest even into the
    cache, attention in float32 over what the cache holds (the reference reads the same values)."""
    case = Case(**{**CASES[name].__dict__, "cache_dtype": torch.bfloat16})
    actual, expected, caches, ref_caches = run_case(case, make_metadata, make_block_tables)
    assert actual.dtype == torch.float32 and caches[0].dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)
    for cache, ref_cache in zip(caches, ref_caches):
        assert torch.equal(cache, ref_cache)


# Long chunks (>= SDPA_MIN_QUERY_ROWS query rows) between short ones, so that the kernel's share
# falls into several runs: decodes, a short extend, a fresh prefill, a long extend, a short one.
SPLIT_CASE = Case(decode_contexts=(40, 3, 70), chunks=((9, 5), (0, 40), (33, 24), (12, 3), (50, 16)),
                  num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("route", ["kernel", "sdpa", "amx", "amx_paged_decodes"])
def test_prefill_chunks_split_off_match_the_reference(route: str, window: int | None, make_metadata,
                                                      make_block_tables) -> None:
    """The AMX split (bfloat16 prefill chunks to SDPA or the AMX tile kernel, the rest to the
    paged kernel, or with "amx" every sequence to the AMX kernel) forced on and off; a window
    keeps long chunks on SDPA and the rest on the paged kernel."""
    from worker.kernels import cpu_ops
    case = Case(**{**SPLIT_CASE.__dict__, "sliding_window": window})
    amx = route.startswith("amx")
    if amx and not cpu_ops.amx_attention_available():
        pytest.skip("no AMX-BF16 tiles here")
    backend = TorchAttentionBackend(sdpa_prefill=route != "kernel", amx_attention=amx,
                                    amx_decodes=route == "amx")
    if route != "kernel" and not backend.use_cpu_kernel:
        pytest.skip("the CPU kernel is unavailable: there is nothing to split")
    actual, expected, caches, ref_caches = run_case(case, make_metadata, make_block_tables, backend=backend)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
    for cache, ref_cache in zip(caches, ref_caches):
        assert torch.equal(cache, ref_cache)


def test_split_sends_long_chunks_to_sdpa(make_metadata, make_block_tables) -> None:
    from worker.attention.prefill_split import KernelSplit, sdpa_sequences
    case = SPLIT_CASE
    contexts = list(case.decode_contexts) + [c for c, _ in case.chunks]
    query_lens = [1] * len(case.decode_contexts) + [q for _, q in case.chunks]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    tables = make_block_tables(seq_lens, case.block_size, 64, torch.Generator().manual_seed(0))
    meta = make_metadata(contexts, query_lens, tables, case.block_size, len(case.decode_contexts))
    assert sdpa_sequences(meta) == [4, 5, 7]
    runs = [(first, end, a, b, rel.tolist()) for first, end, a, b, rel in KernelSplit(meta, [4, 5, 7]).kernel_runs]
    assert runs == [(0, 4, 0, 8, [0, 1, 2, 3, 8]), (6, 7, 72, 75, [0, 3])]


SOFTCAP_CASES = ["mixed", "only_extends", "window_3", "long_prefills_window", "many_decodes"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SOFTCAP_CASES)
def test_softcap_matches_reference(name: str, dtype: torch.dtype, make_metadata, make_block_tables) -> None:
    """Soft-capped scores (Gemma 2) take the PyTorch path, even where the C++ kernel would run."""
    # Scale 1: scores of a few units, which a cap of 1.5 changes a lot.
    case = Case(**{**CASES[name].__dict__, "softcap": 1.5, "scale": 1.0, "dtype": dtype})
    actual, expected, caches, ref_caches = run_case(case, make_metadata, make_block_tables)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)
    for cache, ref_cache in zip(caches, ref_caches):
        assert torch.equal(cache, ref_cache)
    # The cap matters: the uncapped reference is far from the capped one.
    uncapped, _, _, _ = run_case(Case(**{**case.__dict__, "softcap": None}), make_metadata, make_block_tables)
    assert (uncapped.float() - expected.float()).abs().max() > 0.1


def test_backend_without_softcap_is_refused() -> None:
    from worker.attention.step_context import paged_attention, step_context

    class PlainBackend:
        name = "plain"

        def forward(self, *args, **kwargs):
            raise AssertionError("must not be called with a softcap it cannot apply")

    q = torch.zeros(1, 2, 4)
    with step_context(PlainBackend(), None, [(None, None)]):
        with pytest.raises(ValueError, match="cannot apply attention logit soft-capping"):
            paged_attention(q, q, q, 0, 1.0, None, softcap=5.0)


def test_window_changes_the_result(make_metadata, make_block_tables) -> None:
    """Guards the window tests against a window that is silently ignored."""
    windowed, _, _, _ = run_case(CASES["window_3"], make_metadata, make_block_tables)
    unwindowed = Case(**{**CASES["window_3"].__dict__, "sliding_window": None})
    full, _, _, _ = run_case(unwindowed, make_metadata, make_block_tables)
    assert not torch.allclose(windowed, full, atol=1e-3)


def test_reads_context_through_block_table(make_metadata) -> None:
    """One decode attending to hand-made keys: only the positions its block table
    names may contribute, in the order the table gives."""
    block_size, num_blocks, head_dim = 2, 6, 4
    k_cache = torch.zeros(num_blocks, block_size, 1, head_dim)
    v_cache = torch.zeros(num_blocks, block_size, 1, head_dim)
    k_cache[4, 0, 0, 0] = 100.0  # position 0 (block 4): a key the query matches strongly
    v_cache[4, 0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    v_cache[1, 0, 0] = 50.0  # block 1 is not in the table: must never be read
    meta = make_metadata([3], [1], [[4, 2]], block_size, num_decodes=1)
    query = torch.zeros(1, 1, head_dim)
    query[0, 0, 0] = 1.0
    new_kv = torch.zeros(1, 1, head_dim)
    out = TorchAttentionBackend().forward(query, new_kv, new_kv, k_cache, v_cache, meta,
                                          scale=1.0, sliding_window=None)
    torch.testing.assert_close(out[0, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert int(meta.slot_mapping[0]) == 2 * block_size + 1  # position 3 -> block 2, offset 1


@pytest.mark.parametrize("window", [None, 20])
def test_length_buckets_partition_the_decodes(window: int | None) -> None:
    seq_lens = [1 + (i * 37) % 300 for i in range(100)]
    buckets = bucket_by_length(seq_lens, block_size=4, sliding_window=window)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(100))
    assert all(len(bucket) >= MIN_BUCKET_SEQS for bucket in buckets)
    if window is None:
        assert len(buckets) > 2
        for bucket in buckets[:-1]:  # the last one also takes the short leftovers
            blocks = [-(-seq_lens[i] // 4) for i in bucket]
            assert max(blocks) <= 2 * min(blocks)
    else:
        assert len(buckets) == 1  # past the window every decode reads the same number of blocks


def test_factory() -> None:
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")
