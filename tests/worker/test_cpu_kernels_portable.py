"""The kernels' paths for CPUs without AVX-512, built and run here: a second build of the
extension with `-mno-avx512f` (its own cache name, its operators under their own
torch.library namespace) against the same plain-PyTorch references as the native build.
The packed matmuls and the lm_head screens need AVX-512: that build must say it lacks them."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.attention.reference import reference_attention
from worker.attention.torch_backend import TorchAttentionBackend
from worker.lm_head.near_tie_rescore import NearTopScan, near_top_scan
from worker.kernels import cpu_extension
from worker.logprobs import select_logprobs, token_logprobs
from worker.models.rotary import apply_rotary
from worker.random_race import sample_random_rows, sample_random_rows_reference

PORTABLE_FLAGS = [*cpu_extension.CFLAGS, "-mno-avx512f", "-DPAGEDSERVE_OPS=pagedserve_portable"]

# slow: the second build takes ~9 minutes on 2 cores (make test-slow)
pytestmark = [pytest.mark.skipif(not cpu_extension.expected(), reason="no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def portable() -> Any:
    """The extension without AVX-512 (one build, cached like the native one)."""
    ldflags = list(cpu_extension.LDFLAGS)
    module = cpu_extension.build(PORTABLE_FLAGS, prefix="pagedserve_cpu_kernels_portable")
    assert cpu_extension.LDFLAGS == ldflags, "a build changed the flags, and so the next build's cache name"
    return module


@pytest.fixture
def use_portable(portable: Any, monkeypatch) -> Any:
    """Route the kernels' Python entry points (and so their callers) to the portable build."""
    monkeypatch.setattr(cpu_extension, "_module", portable)
    return portable


def test_the_portable_build_has_no_avx512_paths(portable):
    assert portable.OP_NAMESPACE == "pagedserve_portable"
    assert not portable.f32_linear_available() and not portable.bf16_linear_available()
    assert not portable.screened_argmax_available() and not portable.bf16_screen_available()
    assert not portable.amx_attention_available() and not portable.shared_prefix_attention_available()


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
                                               (torch.bfloat16, torch.float8_e5m2)])
@pytest.mark.parametrize("window", [None, 37])
def test_portable_attention_and_cache_write_match_the_reference(use_portable, dtype, cache_dtype, window,
                                                                make_metadata, make_block_tables):
    """Decodes of assorted lengths, a fresh prefill and a chunk that extends a context, with
    GQA (9 query heads on 3 KV heads); the backend writes K/V with the kernel first. 8-bit
    caches with K/V scales other than 1."""
    scales = {"k_scale": 0.5, "v_scale": 1.25} if cache_dtype.itemsize == 1 else {}
    g = torch.Generator().manual_seed(0)
    contexts, query_lens = [0, 5, 17, 100, 40, 0, 61], [1, 1, 1, 1, 1, 50, 23]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    num_blocks = sum(-(-n // 16) for n in seq_lens) + 4
    meta = make_metadata(contexts, query_lens, make_block_tables(seq_lens, 16, num_blocks, g), 16, num_decodes=5)
    caches = [torch.randn(num_blocks, 16, 3, 64, generator=g).to(cache_dtype) for _ in range(2)]
    query, key, value = (torch.randn(sum(query_lens), h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    expected_caches = [c.clone() for c in caches]
    expected = reference_attention(query, key, value, *expected_caches, meta, scale=0.125, sliding_window=window,
                                   **scales)
    backend = TorchAttentionBackend(use_cpu_kernel=True)
    assert backend.use_cpu_kernel
    out = backend.forward(query, key, value, *caches, meta, scale=0.125, sliding_window=window, **scales)
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    for got, want in zip(caches, expected_caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_portable_near_top_scan_matches_eager(use_portable, dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 3001, generator=g) * 4).round().to(dtype)  # many exact ties; odd width
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie at the top: the lower id wins
    logits[6] = float("-inf")
    scan = NearTopScan(compile=False, use_kernel=True)
    for rows in (logits, logits[4:5], logits[:, :7]):
        ids, counts = scan(rows, torch.bfloat16)
        expected_ids, expected_counts = near_top_scan(rows.contiguous(), torch.bfloat16)
        assert torch.equal(ids, expected_ids) and torch.equal(counts, expected_counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_sampling_samples_what_the_reference_samples(use_portable, dtype):
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 128, 1000
    logits = (torch.randn(rows, vocab, generator=gen) * torch.tensor([0.5, 3.0]).repeat(rows // 2)[:, None]).to(dtype)
    logits[1::7, ::3] = float("-inf")
    temperature = torch.rand(rows, generator=gen) + 0.2
    top_k = torch.randint(0, 50, (rows,), generator=gen)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.rand(rows, generator=gen) * 0.9 + 0.1,
                        torch.ones(rows))
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.3, torch.full((rows,), 0.05), torch.zeros(rows))
    keys = torch.randint(-2 ** 63, 2 ** 63 - 1, (rows,), generator=gen)
    for filters in [(None, None, None), (top_k, None, None), (None, top_p, None), (top_k, top_p, min_p)]:
        ours = sample_random_rows(logits, temperature, *filters, keys)
        reference = sample_random_rows_reference(logits, temperature, *filters, keys)
        assert (ours != reference).sum().item() <= 2  # the logs may differ in the last bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_logprobs_equal_log_softmax_topk(use_portable, dtype):
    torch.manual_seed(5)
    rows, vocab = 12, 1003
    logits = (torch.randn(rows, vocab) * torch.linspace(0.1, 12, rows).unsqueeze(1)).to(dtype)
    chosen = torch.randint(0, vocab, (rows,))
    num_top = [0, 1, 5, 20] * 3
    ours = token_logprobs(logits, chosen, num_top)
    reference = select_logprobs(logits.float().log_softmax(dim=-1), chosen, num_top)
    for got, want in zip(ours, reference):
        assert got.token_id == want.token_id and got.rank == want.rank
        assert got.logprob == pytest.approx(want.logprob, abs=2e-5, rel=1e-6)
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=2e-5, rel=1e-6)


@pytest.mark.parametrize("tokens,head_dim", [(5, 64), (3, 48)])
def test_portable_rotary_rounds_like_eager(portable, tokens, head_dim):
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads = 9, 3
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).bfloat16()
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 100
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).bfloat16() for f in (torch.cos, torch.sin))
    q, k = getattr(torch.ops, portable.OP_NAMESPACE).rotary_qk(qkv, cos, sin, heads, kv_heads)
    q_ref = apply_rotary(qkv[:, :heads * head_dim].view(tokens, heads, head_dim), cos, sin)
    k_ref = apply_rotary(qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim),
                         cos, sin)
    assert torch.equal(q.view(torch.int16), q_ref.view(torch.int16))
    assert torch.equal(k.view(torch.int16), k_ref.view(torch.int16))
