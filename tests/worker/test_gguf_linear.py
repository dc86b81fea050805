"""The GGUF quantized matmul (`pagedserve::gguf_linear`, worker/csrc/gguf_linear.cpp) against
gguf's own dequantize: the weights it multiplies are `gguf.quants.dequantize`'s bit for bit, and
its products are the packed matmul's over those weights (float32, and bfloat16 where the CPU has
AVX512-BF16) and close to x @ W.T in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from worker.kernels import cpu_extension, cpu_ops
from worker.models.packed_linear import pack_gated, pack_weight
from worker.quantization.gguf_packing import concat_rows, pack, pack_gated_rows, unpack_tensor

pytestmark = pytest.mark.skipif(not cpu_ops.packed_linear_available(torch.float32),
                                reason="the packed kernels need AVX-512 and a compiler")
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]
K = 512  # two super-blocks of the K-quants
N = 40  # not a multiple of the panels' 16 rows


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid raw blocks [rows, bytes per row]: gguf's quantize where it has one, else random
    bytes with sane float16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    size = {T.Q4_K: 144, T.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (blocks.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype == T.Q4_K:
        blocks[:, :4] = scales  # d, dmin
    else:
        blocks[:, 208:210] = scales[:, :2]  # d
    return blocks.reshape(rows, -1)


def packed_of(qtype: T, rows: int, cols: int, seed: int):
    raw = random_blocks(qtype, rows, cols, seed)
    return raw, unpack_tensor(raw, qtype, rows, cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpacked_weights_are_gguf_dequantize_bit_for_bit(qtype):
    raw, rows = packed_of(qtype, N, K, seed=1)
    got = cpu_extension.load().gguf_dequantize(pack(rows), K)[:N]
    expected = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32))
    assert got.shape == expected.shape
    # Bit for bit, but for the sign of zero: scale * q + offset gives +0.0 where gguf's d * (q - z)
    # gives -0.0 (a negative d), which no product or sum tells apart from +0.0.
    nonzero = expected != 0
    assert torch.equal(got == 0, ~nonzero)
    assert torch.equal(got[nonzero].view(torch.int32), expected[nonzero].view(torch.int32))


# Chunk bytes: 4-bit values of 32 with float16 scales and offsets where gguf's are float16 (Q4_0,
# Q4_1; Q8_0's offset -128 d too), float32 where they are products (the K-quants' sub-scales).
CHUNK_BYTES = {T.Q8_0: 64 + 512, T.Q4_0: 64 + 256, T.Q4_1: 64 + 256, T.Q4_K: 128 + 256, T.Q6_K: 128 + 192 + 16}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_scales_are_stored_in_float16_only_where_exact(qtype):
    _, rows = packed_of(qtype, N, K, seed=5)
    assert pack(rows).shape[2] == CHUNK_BYTES[qtype]


def test_a_q8_0_scale_past_float16s_range_keeps_float32():
    """d = 1000 is a float16, but the offset -128 d is not (past 65504): the chunks keep float32."""
    raw, _ = packed_of(T.Q8_0, 16, K, seed=6)
    raw = raw.reshape(-1, 34).copy()
    raw[0, :2] = np.array([1000], dtype=np.float16).view(np.uint8)
    raw = raw.reshape(16, -1)
    packed = pack(unpack_tensor(raw, T.Q8_0, 16, K))
    assert packed.shape[2] == 128 + 512
    expected = torch.from_numpy(np.asarray(dequantize(raw, T.Q8_0), dtype=np.float32))
    assert torch.equal(cpu_extension.load().gguf_dequantize(packed, K), expected)


@pytest.mark.parametrize("types", [(T.Q4_1, T.Q6_K), (T.Q4_0, T.Q8_0), (T.Q4_K, T.Q6_K, T.Q8_0)],
                         ids=lambda types: "+".join(t.name for t in types))
def test_mixed_parts_share_the_widest_layout(types):
    parts = [packed_of(t, 24, K, seed=i) for i, t in enumerate(types)]
    packed = pack(concat_rows([rows for _, rows in parts]))
    weight = torch.from_numpy(np.concatenate([dequantize(raw, t) for (raw, _), t in zip(parts, types)]))
    assert torch.equal(cpu_extension.load().gguf_dequantize(packed, K)[:weight.shape[0]], weight)
    x = torch.randn(3, K)
    assert torch.equal(torch.ops.pagedserve.gguf_linear(x, packed, weight.shape[0], None),
                       torch.ops.pagedserve.packed_linear(x, pack_weight(weight), weight.shape[0], None))


FOUR_BIT = (T.Q4_0, T.Q4_1, T.Q4_K)
DTYPES = [torch.float32] + ([torch.bfloat16] if cpu_ops.packed_linear_available(torch.bfloat16) else [])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_matmul_is_the_packed_matmul_of_the_dequantized_weight(qtype, dtype, gated):
    raw, rows = packed_of(qtype, 2 * N if gated else N, K, seed=2)
    weight = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32))
    if gated:
        packed = pack_gated_rows(*(unpack_tensor(part, qtype, N, K) for part in np.split(raw, 2)))
        reference_packed = pack_gated(weight.to(dtype))
        op, ref_op = torch.ops.pagedserve.gguf_linear_silu, torch.ops.pagedserve.packed_linear_silu
    else:
        packed, reference_packed = pack(rows), pack_weight(weight.to(dtype))
        op, ref_op = torch.ops.pagedserve.gguf_linear, torch.ops.pagedserve.packed_linear
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(weight.shape[0], generator=generator).to(dtype)
    for m in (1, 2, 4, 5, 8, 33, 300):
        x = torch.randn(m, K, generator=generator).to(dtype)
        for b in (None, bias):
            got = op(x, packed, N, b)
            assert got.shape == (m, N) and got.dtype == dtype
            expected = ref_op(x, reference_packed, N, b)
            # Decode rows x 4-bit weights in bfloat16 multiply by the weights unrounded.
            unrounded = dtype == torch.bfloat16 and qtype in FOUR_BIT and m <= 4

            def product(w):
                y = x.double() @ w.double().T + (0 if b is None else b.double())
                return torch.nn.functional.silu(y[:, :N]) * y[:, N:] if gated else y

            full = product(weight if unrounded else weight.to(dtype))
            tolerance = 1e-3 if dtype == torch.float32 else 3e-2  # the kernel's exp in silu
            torch.testing.assert_close(got.double(), full, rtol=tolerance, atol=tolerance)
            if unrounded:  # at least as close to the exact product as the rounded weights' path
                error = (got.double() - full).norm() / full.norm()
                assert error <= 1.1 * (expected.double() - full).norm() / full.norm() + 1e-4, f"m={m}"
            else:
                # The same function as the dequantized path's kernel, summed in the same order.
                assert torch.equal(got, expected), f"m={m} bias={b is not None}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_dense_route_multiplies_the_dequantized_weight(qtype, gated):
    """With `dense` (AMX CPUs), bfloat16 batches of 64 rows or more go through the weight
    dequantized to bfloat16 (the gated packing's panels put back in gate/up order) and F.linear,
    bit for bit; fewer rows take the kernel, exactly as without it."""
    if torch.bfloat16 not in DTYPES:
        pytest.skip("the bfloat16 GGUF kernels need AVX512-BF16")
    n = 3 * 16 + 5  # gate/up panels: whole blocks of four and a last block with one of each
    raw, rows = packed_of(qtype, 2 * n if gated else n, K, seed=4)
    weight = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32)).bfloat16()
    if gated:
        packed = pack_gated_rows(*(unpack_tensor(part, qtype, n, K) for part in np.split(raw, 2)))
        op = torch.ops.pagedserve.gguf_linear_silu
    else:
        packed, op = pack(rows), torch.ops.pagedserve.gguf_linear
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(weight.shape[0], generator=generator).bfloat16()
    for m in (63, 64, 200):
        x = torch.randn(m, K, generator=generator).bfloat16()
        for b in (None, bias):
            got = op(x, packed, n, b, True)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            if m < 64:
                assert torch.equal(got, op(x, packed, n, b, False))
                continue
            # F.linear of the dequantized weights, as `--quantization none` runs it on AMX CPUs
            expected = torch.nn.functional.linear(x, weight, b)
            if gated:
                expected = torch.nn.functional.silu(expected[:, :n]).mul_(expected[:, n:])
            assert torch.equal(got, expected), f"m={m} bias={b is not None}"


def test_bad_shapes_are_refused_with_a_message():
    _, rows = packed_of(T.Q4_1, N, K, seed=4)
    packed = pack(rows)
    for k in (K - 8, K // 2):
        with pytest.raises(RuntimeError, match="columns are not the weight's"):
            torch.ops.pagedserve.gguf_linear(torch.randn(2, k), packed, N, None)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        torch.ops.pagedserve.gguf_linear(torch.randn(2, K), packed, N + 16, None)
    with pytest.raises(RuntimeError, match="match no layout"):
        torch.ops.pagedserve.gguf_linear(torch.randn(2, K), packed[:, :, :-1].contiguous(), N, None)
