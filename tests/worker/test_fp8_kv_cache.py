"""The 8-bit float KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) on CPU: the K/V write against
torch's conversion bit for bit, and the C++ attention kernel and the PyTorch fallback against the
reference attention over the same (dequantized) cache, with per-layer scales other than 1."""
from __future__ import annotations

import pytest
import torch

from worker.attention.fp8_kv import from_cache, to_cache
from worker.attention.reference import reference_attention
from worker.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from worker.kernels import cpu_extension, cpu_ops

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
needs_kernels = pytest.mark.skipif(not cpu_extension.expected(), reason="no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0")


def awkward_values(dtype: torch.dtype, count: int = 4096) -> torch.Tensor:
    """Values of every binade (subnormal to beyond the largest finite), every code and the exact
    midpoints between neighbouring codes (ties), and +-inf, NaN, +-0."""
    g = torch.Generator().manual_seed(7)
    magnitudes = torch.exp2(torch.empty(count).uniform_(-24, 18, generator=g))
    values = torch.where(torch.rand(count, generator=g) < 0.5, -magnitudes, magnitudes)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[codes.isfinite()]
    ties = (codes[:-1] + codes[1:]) / 2
    special = torch.tensor([0.0, -0.0, 1e9, -1e9, float("inf"), float("-inf"), float("nan"), 447.9, 464.0, 480.0,
                            57344.0, 61440.0])
    x = torch.cat([values, codes, ties, special])
    return torch.cat([x, x.new_zeros(-x.numel() % 128)]).view(-1, 2, 64)  # [tokens, 2 KV heads, 64]


@needs_kernels
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", FP8)
def test_cpu_cache_write_is_torchs_conversion_bit_for_bit(source, cache_dtype):
    """Stored = real / scale, saturated to the largest finite value, rounded to nearest even:
    the kernel's bytes are those of `fp8_kv.to_cache` (torch's `.to`), and so are the fallback's."""
    assert cpu_ops.load() is not None
    x = awkward_values(cache_dtype).to(source)
    slots = torch.randperm(x.shape[0] * 2, generator=torch.Generator().manual_seed(1))[:x.shape[0]]
    k_scale, v_scale = 0.37, 3.0
    expected = [torch.zeros(x.shape[0] * 2, 2, 64, dtype=cache_dtype) for _ in range(2)]
    expected[0].view(torch.uint8)[slots] = to_cache(x, cache_dtype, k_scale).view(torch.uint8)
    expected[1].view(torch.uint8)[slots] = to_cache(-x, cache_dtype, v_scale).view(torch.uint8)
    for write in (cpu_ops.write_kv_cache, write_kv_cache):
        caches = [torch.zeros(x.shape[0], 2, 2, 64, dtype=cache_dtype) for _ in range(2)]
        write(x, -x, *caches, slots.to(torch.int64), k_scale, v_scale)
        for got, want in zip(caches, expected):
            assert torch.equal(got.view(torch.uint8).flatten(), want.view(torch.uint8).flatten())
    # Saturation, not overflow to inf (e5m2 has an inf; torch's `.to` would produce it).
    stored = from_cache(expected[0], torch.float32)
    assert not stored.isinf().any() and stored.isnan().sum() == 1  # the one NaN input stays NaN
    assert stored.nan_to_num().abs().max() == torch.finfo(cache_dtype).max


def test_fp8_scales_must_be_positive_and_only_for_fp8():
    if cpu_ops.load() is None:
        pytest.skip("no CPU kernels")
    x = torch.randn(2, 1, 16)
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="k_scale/v_scale must be positive"):
        cpu_ops.write_kv_cache(x, x, *[torch.zeros(1, 2, 1, 16, dtype=torch.float8_e4m3fn)] * 2, slots, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="1 unless the cache holds 8-bit floats"):
        cpu_ops.write_kv_cache(x, x, *[torch.zeros(1, 2, 1, 16)] * 2, slots, 2.0, 1.0)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", FP8)
def test_kernel_reads_every_finite_code_exactly(cache_dtype, make_metadata):
    """A sequence of one position attends to it alone: the output is that V row times v_scale,
    exactly. Every finite code (subnormals included) in the V rows of 4 one-position sequences."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes.view(cache_dtype).float().isfinite()
    v_rows = torch.where(finite, codes, 0).view(4, 1, 1, 64).view(cache_dtype)  # blocks 0..3 of 1 slot, 1 KV head
    v_cache = torch.cat([torch.zeros(1, 1, 1, 64, dtype=cache_dtype), v_rows])  # block 0: the null block
    k_cache = torch.zeros_like(v_cache)
    meta = make_metadata([0] * 4, [1] * 4, [[1], [2], [3], [4]], 1, num_decodes=4)
    for query_dtype in (torch.float32, torch.bfloat16):
        query = torch.randn(4, 2, 64).to(query_dtype)
        out = torch.empty_like(query)
        cpu_ops.paged_attention(out, query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                meta.seq_lens, 0.125, None, k_scale=1.0, v_scale=0.5)
        expected = (v_rows.float() * 0.5).view(4, 1, 64).expand(4, 2, 64).to(query_dtype)
        assert torch.equal(out, expected)


CASES = {
    # decodes of assorted lengths, a fresh prefill, chunks extending a context; GQA 9 on 3 KV heads
    "mixed_dim_64": dict(contexts=[0, 5, 17, 100, 40, 0, 61], query_lens=[1, 1, 1, 1, 1, 50, 23], num_decodes=5,
                         heads=9, kv_heads=3, dim=64, block_size=16),
    "decodes_block_256": dict(contexts=[300, 7, 511, 256], query_lens=[1] * 4, num_decodes=4, heads=6, kv_heads=2,
                              dim=32, block_size=256),
    "prefills_dim_16": dict(contexts=[0, 9, 3], query_lens=[11, 20, 5], num_decodes=0, heads=4, kv_heads=2,
                            dim=16, block_size=4),
}


@pytest.mark.parametrize("use_cpu_kernel", [pytest.param(True, marks=needs_kernels), False],
                         ids=["kernel", "fallback"])
@pytest.mark.parametrize("window", [None, 29])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("name", list(CASES))
def test_attention_over_fp8_cache_matches_reference(name, cache_dtype, query_dtype, window, use_cpu_kernel,
                                                    make_metadata, make_block_tables):
    """The backend writes the new K/V and attends; the reference does the same with its own plain
    write and per-slot reads. Scales other than 1 on both K and V."""
    case = CASES[name]
    g = torch.Generator().manual_seed(3)
    contexts, query_lens, block_size = case["contexts"], case["query_lens"], case["block_size"]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    meta = make_metadata(contexts, query_lens, make_block_tables(seq_lens, block_size, num_blocks, g), block_size,
                         num_decodes=case["num_decodes"])
    k_scale, v_scale = 0.25, 1.5
    shape = (num_blocks, block_size, case["kv_heads"], case["dim"])
    caches = [to_cache(torch.randn(shape, generator=g) * 3, cache_dtype, s) for s in (k_scale, v_scale)]
    tokens = sum(query_lens)
    query = torch.randn(tokens, case["heads"], case["dim"], generator=g).to(query_dtype)
    key, value = (torch.randn(tokens, case["kv_heads"], case["dim"], generator=g).mul(3).to(query_dtype)
                  for _ in range(2))
    expected_caches = [c.clone() for c in caches]
    scale = case["dim"] ** -0.5
    expected = reference_attention(query, key, value, *expected_caches, meta, scale=scale, sliding_window=window,
                                   k_scale=k_scale, v_scale=v_scale)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    assert backend.use_cpu_kernel == use_cpu_kernel
    out = backend.forward(query, key, value, *caches, meta, scale=scale, sliding_window=window, k_scale=k_scale,
                          v_scale=v_scale)
    assert out.dtype == query_dtype
    # bfloat16: the output's rounding (and the fallback's bf16 matmuls) on values of magnitude ~10
    tolerance = dict(atol=3e-5, rtol=1e-5) if query_dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    for got, want in zip(caches, expected_caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # The V scale reaches the output: the same cache read with v_scale 1 gives another result.
    unscaled = reference_attention(query, key, value, *[c.clone() for c in caches], meta, scale=scale,
                                   sliding_window=window, k_scale=k_scale, v_scale=1.0)
    assert not torch.allclose(unscaled.float(), expected.float(), atol=1e-2)
