"""The CPU fast path computes the same function as the plain path: the C++ attention
kernel, the compiled model step, packed bf16 matmuls, and their fallbacks."""
from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from pagedserve.bench.workloads import BenchRequest, NAMED_WORKLOADS, generate_workload
from tiny_models import build_tiny_hf_model, hf_greedy
from worker.kernels import cpu_extension, cpu_ops
from worker.attention.reference import reference_attention
from worker.attention.torch_backend import TorchAttentionBackend
from pagedserve.bench.fast_path_check import first_step_logits, greedy_tokens, relative_l2
from pagedserve.offline.llm import LLM
from worker.models import packed_linear

needs_kernel = pytest.mark.skipif(not cpu_extension.expected(), reason="no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0")


@pytest.fixture(autouse=True)
def packed_kernels_only(monkeypatch):
    """These tests check the packed kernels at every row count, so AMX CPUs do not hand many
    rows to PyTorch's matmul here (test_dense_weight_takes_many_rows checks that route)."""
    monkeypatch.setattr(packed_linear, "_DENSE_BF16", False)


# --- attention: kernel and PyTorch fallback against the reference -----------------------
@needs_kernel
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("window", [None, 37])
def test_kernel_and_fallback_match_reference_at_model_shapes(dtype, cache_dtype, window, make_metadata,
                                                             make_block_tables):
    """SmolLM2's head layout (9 query heads on 3 KV heads of 64), blocks of 16: decodes of
    assorted lengths plus a fresh prefill and a chunk that extends a context; float32 queries
    over a bfloat16 cache too (--kv-cache-dtype bfloat16)."""
    g = torch.Generator().manual_seed(0)
    contexts = [0, 5, 17, 100, 333, 40, 0, 61]
    query_lens = [1, 1, 1, 1, 1, 1, 50, 23]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    num_blocks = sum(-(-n // 16) for n in seq_lens) + 4
    meta = make_metadata(contexts, query_lens, make_block_tables(seq_lens, 16, num_blocks, g), 16, num_decodes=6)
    tokens = sum(query_lens)
    caches = [torch.randn(num_blocks, 16, 3, 64, generator=g).to(cache_dtype) for _ in range(2)]
    query, key, value = (torch.randn(tokens, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    expected = reference_attention(query, key, value, *[c.clone() for c in caches], meta, scale=0.125,
                                   sliding_window=window)
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for use_kernel in (True, False):
        k_cache, v_cache = (c.clone() for c in caches)
        out = TorchAttentionBackend(use_cpu_kernel=use_kernel).forward(
            query, key, value, k_cache, v_cache, meta, scale=0.125, sliding_window=window)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 80, 96, 128])
@pytest.mark.parametrize("window", [None, 29])
def test_kernel_prefill_matches_reference_at_other_head_dims(dtype, head_dim, window, make_metadata,
                                                             make_block_tables):
    """Prefill items score against keys transposed per chunk (float32: 16 dims at a time; bf16
    on vdpbf16ps, 32 at a time, 80 taking the float32-FMA scoring): head dims other than
    SmolLM2's, chunks cut short, windows, next to a decode item."""
    g = torch.Generator().manual_seed(2)
    contexts, query_lens = [3, 0, 45, 0], [1, 70, 19, 9]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    num_blocks = sum(-(-n // 16) for n in seq_lens) + 3
    meta = make_metadata(contexts, query_lens, make_block_tables(seq_lens, 16, num_blocks, g), 16, num_decodes=1)
    caches = [torch.randn(num_blocks, 16, 2, head_dim, generator=g).to(dtype) for _ in range(2)]
    query, key, value = (torch.randn(sum(query_lens), h, head_dim, generator=g).to(dtype) for h in (6, 2, 2))
    scale = head_dim ** -0.5
    expected = reference_attention(query, key, value, *[c.clone() for c in caches], meta, scale=scale,
                                   sliding_window=window)
    out = TorchAttentionBackend(use_cpu_kernel=True).forward(query, key, value, *caches, meta, scale=scale,
                                                             sliding_window=window)
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_kernel_cache_write_matches_index_copy(dtype, cache_dtype):
    """K/V as strided views of a fused QKV projection, scattered to shuffled slots (and rounded
    to nearest even, as Tensor.to does, into a bfloat16 cache)."""
    from worker.attention.torch_backend import write_kv_cache
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(37, 960, generator=g).to(dtype)
    key, value = qkv[:, 576:768].view(37, 3, 64), qkv[:, 768:].view(37, 3, 64)
    slots = torch.randperm(12 * 16, generator=g)[:37]
    expected = [torch.zeros(12, 16, 3, 64, dtype=cache_dtype) for _ in range(2)]
    actual = [torch.zeros(12, 16, 3, 64, dtype=cache_dtype) for _ in range(2)]
    write_kv_cache(key, value, *expected, slots)
    cpu_ops.write_kv_cache(key, value, *actual, slots)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.write_kv_cache(key, value, *actual, torch.full((37,), 12 * 16))


@needs_kernel
@pytest.mark.parametrize("tokens,head_dim", [(1, 64), (37, 48), (600, 64), (5, 6)])
def test_kernel_rotary_rounds_like_eager(tokens, head_dim):
    """Bit for bit eager bf16's apply_rotary on q and k read out of a fused qkv projection:
    one thread or many, half a head past the vector loop (48, 6), extreme values."""
    from worker.models.rotary import apply_rotary
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads = 9, 3
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).bfloat16()
    qkv[0, :4] = torch.tensor([3e38, -3e38, float("inf"), float("nan")])
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 100
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).bfloat16() for f in (torch.cos, torch.sin))
    q, k = cpu_ops.rotary_qk(qkv, cos, sin, heads, kv_heads)
    q_ref = apply_rotary(qkv[:, :heads * head_dim].view(tokens, heads, head_dim), cos, sin)
    k_ref = apply_rotary(qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim),
                         cos, sin)
    for got, want in ((q, q_ref), (k, k_ref)):
        assert got.shape == want.shape and got.is_contiguous()
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert bool(same.all())
    with pytest.raises(RuntimeError, match="narrower"):
        cpu_ops.rotary_qk(qkv[:, :heads * head_dim], cos, sin, heads, kv_heads)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_ops.rotary_qk(qkv.float(), cos, sin, heads, kv_heads)


def test_kernel_switch_off_falls_back(monkeypatch):
    monkeypatch.setenv(cpu_extension.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_extension, "_module", None)
    monkeypatch.setattr(cpu_extension, "_failed", False)
    assert cpu_ops.load() is None
    assert TorchAttentionBackend().use_cpu_kernel is False
    with pytest.raises(RuntimeError, match="unavailable"):
        TorchAttentionBackend(use_cpu_kernel=True)


# --- packed matmuls (bfloat16 with AVX512-BF16, float32 with AVX-512) -----------------------
PACKED_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="f32")]


def needs_packed(dtype: torch.dtype) -> None:
    if cpu_extension.expected():
        cpu_extension.require()  # a failed build fails the test, never skips it
    if not cpu_ops.packed_linear_available(dtype):
        pytest.skip(f"the CPU kernel's {dtype} matmul needs {'AVX512-BF16' if dtype == torch.bfloat16 else 'AVX-512'}"
                    " and a compiler")


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (200, 576), (37, 33), (16, 2)])
def test_packed_linear_matches_f_linear(dtype, out_features, in_features):
    """The packed matmul against float64 F.linear, at every row-tile remainder, with a
    partial last panel (N % 16) and an odd K (zero-padded in the bf16 packed copy)."""
    needs_packed(dtype)
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    packed = packed_linear.pack_weight(weight)
    unit = packed_linear.step_unit(dtype)
    assert packed is not None and packed.shape == ((out_features + 15) // 16, -(-in_features // unit), 16, unit)
    for rows in (1, 2, 3, 4, 5, 7, 300):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        for b in (bias, None):
            expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
            got = packed_linear.linear(x, weight, b, packed)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            if dtype == torch.bfloat16:  # float32 sums rounded once to bf16: within half a bf16 ulp
                assert torch.all((got.double() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-3)
            else:  # float32 sums in K order: rounding errors of K terms of up to |x| |w|
                bound = (x.double().abs() @ weight.double().abs().T) * in_features * 2 ** -24 + 1e-6
                assert torch.all((got.double() - expected).abs() <= bound)
    batched = torch.randn(2, 3, in_features, generator=g).to(dtype)
    assert torch.equal(packed_linear.linear(batched, weight, bias, packed),
                       packed_linear.linear(batched.reshape(6, -1), weight, bias, packed).reshape(2, 3, -1))
    assert packed_linear.linear(batched[:0], weight, bias, packed).shape == (0, 3, out_features)
    assert packed_linear.pack_weight(weight.half()) is None  # float16 keeps F.linear


@needs_kernel
def test_float32_packed_rows_do_not_depend_on_their_batch():
    """A float32 row's result is the same bit for bit whatever rows share its call (the sum runs
    in K order in every tile shape), so greedy outputs do not move with the batch."""
    needs_packed(torch.float32)
    g = torch.Generator().manual_seed(7)
    weight, x = torch.randn(200, 576, generator=g), torch.randn(301, 576, generator=g)
    packed = packed_linear.pack_weight(weight)
    alone = torch.cat([packed_linear.linear(x[i:i + 1], weight, None, packed) for i in range(x.shape[0])])
    assert torch.equal(packed_linear.linear(x, weight, None, packed), alone)
    assert torch.equal(packed_linear.linear(x[5:18], weight, None, packed), alone[5:18])


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("intermediate,in_features", [(1536, 64), (37, 33), (16, 8)])
def test_gated_linear_matches_linear_then_eager_silu(dtype, intermediate, in_features):
    """The SiLU-gated packed matmul against the packed matmul followed by eager F.silu(gate) *
    up (bf16: bit for bit; float32: to the last bits of exp): row-tile remainders, one thread
    or many, a last block with one gate/up pair and a partial panel (37), biases that drive
    gates to +-inf, NaN, huge."""
    needs_packed(dtype)
    g = torch.Generator().manual_seed(intermediate)
    weight = torch.randn(2 * intermediate, in_features, generator=g).to(dtype)
    bias = (torch.randn(2 * intermediate, generator=g) * 4).to(dtype)
    bias[:5] = torch.tensor([100.0, -100.0, float("inf"), float("-inf"), float("nan")])
    gated, plain = packed_linear.pack_gated(weight), packed_linear.pack_weight(weight)
    unit = packed_linear.step_unit(dtype)
    assert gated is not None and gated.shape == (2 * -(-intermediate // 16), -(-in_features // unit), 16, unit)
    for rows in (1, 5, 6, 7, 13, 300):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        for b in (bias, None):
            gate, up = packed_linear.linear(x, weight, b, plain).chunk(2, dim=-1)
            expected = F.silu(gate).mul_(up)
            got = packed_linear.linear_silu(x, weight, b, gated)
            assert got.shape == expected.shape == (rows, intermediate)
            if dtype == torch.bfloat16:
                same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
                assert bool(same.all())
            else:
                torch.testing.assert_close(got, expected, rtol=4e-7, atol=1e-30, equal_nan=True)
    assert packed_linear.linear_silu(x[:0], weight, bias, gated).shape == (0, intermediate)
    with pytest.raises(RuntimeError, match="out_features"):  # the packing holds another width
        torch.ops.pagedserve.packed_linear_silu(x, gated, intermediate + 16, None)
    assert packed_linear.pack_gated(weight[:-1]) is None  # no gate/up halves


@pytest.mark.parametrize("gated", [False, True])
def test_dense_weight_takes_many_rows(gated):
    """Given the plain weight (on AMX CPUs), the packed ops multiply 16 rows or more through
    ATen's matmul, exactly as F.linear (then eager silu(gate) * up) does, and fewer rows
    through the packed kernel, exactly as without it."""
    needs_packed(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    out_features, in_features = 40, 72
    weight = torch.randn((2 if gated else 1) * out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(weight.shape[0], generator=g).bfloat16()
    op = torch.ops.pagedserve.packed_linear_silu if gated else torch.ops.pagedserve.packed_linear
    packed = packed_linear.pack_gated(weight) if gated else packed_linear.pack_weight(weight)
    for rows in (1, 15, 16, 100):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        got = op(x, packed, out_features, bias, weight)
        if rows >= 16:
            expected = F.linear(x, weight, bias)
            if gated:
                gate, up = expected.chunk(2, dim=-1)
                expected = F.silu(gate).mul_(up)
        else:
            expected = op(x, packed, out_features, bias)
        assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="plain weight"):
        op(torch.randn(16, in_features).bfloat16(), packed, out_features, bias, weight[:, 1:])


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_linear_rejects_mismatched_shapes(dtype):
    needs_packed(dtype)
    weight = torch.randn(32, 64).to(dtype)
    packed = packed_linear.pack_weight(weight)
    with pytest.raises(RuntimeError, match="last dimension"):
        packed_linear.linear(torch.randn(4, 62).to(dtype), weight, None, packed)
    with pytest.raises(RuntimeError, match="bias"):
        packed_linear.linear(torch.randn(4, 64).to(dtype), weight, torch.zeros(31, dtype=dtype), packed)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="differ in dtype"):
        torch.ops.pagedserve.packed_linear(torch.randn(4, 64).to(other), packed, 32, None)
    with pytest.raises(RuntimeError, match="takes bfloat16 or float32"):
        torch.ops.pagedserve.packed_linear(torch.randn(4, 64).half(), packed, 32, None)


@needs_kernel
def test_packed_argmax_is_torch_max_of_the_product():
    """The greedy lm_head: the index torch.max picks from the packed product, at model and odd
    sizes, on exact ties (the first wins), with a NaN (the first NaN wins) and all -inf (0)."""
    needs_packed(torch.float32)
    g = torch.Generator().manual_seed(3)
    for out_features, in_features, rows in [(49152, 576, 70), (37, 33, 5), (100, 64, 1), (16, 2, 300)]:
        weight = torch.randn(out_features, in_features, generator=g)
        x = torch.randn(rows, in_features, generator=g)
        packed = packed_linear.pack_weight(weight)
        expected = packed_linear.linear(x, weight, None, packed).max(dim=-1).indices
        assert torch.equal(torch.ops.pagedserve.packed_linear_argmax(x, packed, out_features), expected)
    weight, x = torch.zeros(200, 4), torch.ones(3, 4)
    weight[[10, 40, 190]] = 1.0  # equal products in different panels and thread chunks
    argmax = torch.ops.pagedserve.packed_linear_argmax
    assert argmax(x, packed_linear.pack_weight(weight), 200).tolist() == [10, 10, 10]
    weight[[50, 150]] = float("nan")
    assert argmax(x, packed_linear.pack_weight(weight), 200).tolist() == [50, 50, 50]
    weight.fill_(float("-inf"))
    assert argmax(x, packed_linear.pack_weight(weight), 200).tolist() == [0, 0, 0]
    assert argmax(x[:0], packed_linear.pack_weight(weight), 200).shape == (0,)


# --- the compiled model step ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fast-path")
    return build_tiny_hf_model("LlamaForCausalLM", directory), directory


def tiny_requests(count: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(256) for _ in range(rng.randint(1, 60))], 24) for _ in range(count)]


def engine(directory, dtype: str, eager: bool, **kwargs) -> LLM:
    return LLM(model=str(directory), dtype=dtype, enforce_eager=eager, block_size=4, num_gpu_blocks_override=512,
               skip_tokenizer_init=True, **kwargs)


def test_compiled_float32_agrees_with_eager_and_transformers(tiny_llama):
    hf_model, directory = tiny_llama
    requests = tiny_requests(10)
    # A small token budget mixes chunked prefills with decodes in the same steps.
    compiled = engine(directory, "float32", eager=False, max_num_batched_tokens=40)
    assert compiled.worker.forward.compiled
    eager = engine(directory, "float32", eager=True, max_num_batched_tokens=40)
    ours_compiled, ours_eager = greedy_tokens(compiled, requests), greedy_tokens(eager, requests)
    pairs = [(a, b) for x, y in zip(ours_compiled, ours_eager) for a, b in zip(x, y)]
    assert len(pairs) == 240 and sum(a == b for a, b in pairs) / len(pairs) >= 0.99
    assert ours_compiled == [hf_greedy(hf_model, r.prompt_token_ids, 24) for r in requests]


def test_compiled_bfloat16_first_step_logits_match_eager(tiny_llama):
    _, directory = tiny_llama
    requests = tiny_requests(6, seed=1)
    compiled = first_step_logits(engine(directory, "bfloat16", eager=False), requests)
    eager = first_step_logits(engine(directory, "bfloat16", eager=True), requests)
    assert compiled.shape == (6, 256) and compiled.dtype == torch.float32
    assert relative_l2(compiled, eager) < 1e-2


def test_bfloat16_kv_cache_under_a_float32_model(tiny_llama):
    """--kv-cache-dtype bfloat16: the cache holds bfloat16, the first step's logits stay within
    bf16 rounding of the float32 cache's, and compiled and eager agree on the greedy tokens."""
    _, directory = tiny_llama
    requests = tiny_requests(6, seed=4)
    halved = engine(directory, "float32", eager=False, kv_cache_dtype="bfloat16")
    assert {cache.dtype for pair in halved.worker.kv_caches for cache in pair} == {torch.bfloat16}
    full = engine(directory, "float32", eager=False)
    assert relative_l2(first_step_logits(halved, requests), first_step_logits(full, requests)) < 1e-2
    eager = engine(directory, "float32", eager=True, kv_cache_dtype="bfloat16")
    compiled_tokens, eager_tokens = greedy_tokens(halved, requests), greedy_tokens(eager, requests)
    pairs = [(a, b) for x, y in zip(compiled_tokens, eager_tokens) for a, b in zip(x, y)]
    assert len(pairs) == 144 and sum(a == b for a, b in pairs) / len(pairs) >= 0.99


def test_no_recompilation_while_serving(tiny_llama):
    """After start-up, batches of any size (1 token, chunks, many decodes) reuse the graph."""
    _, directory = tiny_llama
    llm = engine(directory, "float32", eager=False, max_num_batched_tokens=33)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    greedy_tokens(llm, tiny_requests(1, seed=2))  # one sequence: single-token decode steps
    greedy_tokens(llm, tiny_requests(12, seed=3))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_layers_per_graph_is_the_largest_divisor_up_to_the_limit():
    from worker.compiled_forward import layers_per_graph
    assert [layers_per_graph(n, limit=6) for n in (1, 2, 7, 12, 28, 30, 32)] == [1, 2, 1, 6, 4, 6, 4]


def test_one_graph_serves_every_group_of_layers(tmp_path):
    """Twelve layers run as two compiled groups of six: one graph for batches of two tokens or
    more and one for a single token, both made at start-up and reused by both groups and by every
    batch after, computing what eager computes (the tokens transformers picks)."""
    hf_model = build_tiny_hf_model("LlamaForCausalLM", tmp_path, num_hidden_layers=12)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    llm = engine(tmp_path, "float32", eager=False, max_num_batched_tokens=33)
    assert llm.worker.forward.group_size == 6
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2
    requests = tiny_requests(6, seed=5)
    assert greedy_tokens(llm, requests) == [hf_greedy(hf_model, r.prompt_token_ids, 24) for r in requests]
    [alone] = tiny_requests(1, seed=6)  # one sequence: one-token steps
    assert greedy_tokens(llm, [alone]) == [hf_greedy(hf_model, alone.prompt_token_ids, 24)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2


def test_compile_failure_falls_back_to_eager(tiny_llama, caplog):
    _, directory = tiny_llama
    requests = tiny_requests(4, seed=4)
    expected = greedy_tokens(engine(directory, "float32", eager=True), requests)
    llm = engine(directory, "float32", eager=False)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")
    llm.worker.forward._compiled = broken
    with caplog.at_level(logging.WARNING):
        assert greedy_tokens(llm, requests) == expected
    assert not llm.worker.forward.compiled
    assert any("running eager" in r.getMessage() for r in caplog.records)


def test_a_step_that_fails_eager_too_keeps_the_compiled_graph(tiny_llama):
    """A failure the eager model shares is the step's fault, not the compiler's: it is raised
    and the engine keeps its compiled graph (before: it switched to eager for good)."""
    _, directory = tiny_llama
    llm = engine(directory, "float32", eager=False)
    model = llm.worker.model
    real_forward = model.forward_tokens

    def failing_forward(*args, **kwargs):
        raise ValueError("a step that cannot run")
    model.forward_tokens = failing_forward
    with pytest.raises(ValueError, match="cannot run"):
        greedy_tokens(llm, tiny_requests(2, seed=6))
    model.forward_tokens = real_forward
    assert llm.worker.forward.compiled
    requests = tiny_requests(3, seed=7)
    assert greedy_tokens(llm, requests) == greedy_tokens(engine(directory, "float32", eager=True), requests)


# --- bfloat16 against float32 on the real model -----------------------------------------
@pytest.mark.slow  # W1's 64 prompts through two engines; `bench accuracy` reports the same
def test_bfloat16_first_token_matches_float32_on_w1_prompts():
    """The issue's criterion on W1's first 24 prompts (all 64: `pagedserve bench accuracy`),
    with near ties settled in float32 (--greedy-rescore-near-ties, worker.lm_head.near_tie_rescore),
    which this bound was set with; a few prompts have top logits closer than bf16 can tell."""
    requests = [BenchRequest(r.prompt_token_ids, 1)
                for r in generate_workload(NAMED_WORKLOADS["W1"], vocab_size=49152)[:24]]
    bf16 = LLM(dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory=256 << 20, greedy_rescore_near_ties=True)
    fp32 = LLM(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, kv_cache_memory=256 << 20)
    first_bf16 = [t[0] for t in greedy_tokens(bf16, requests)]
    first_fp32 = [t[0] for t in greedy_tokens(fp32, requests)]
    assert sum(a == b for a, b in zip(first_bf16, first_fp32)) / len(requests) >= 0.9
