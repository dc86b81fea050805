"""The W8A8 kernel (worker/csrc/int8_linear.cpp) against the plain PyTorch reference: per-token
activation quantization bit for bit, the int32 products exactly, the epilogue (scales, bias,
silu(gate) * up) to float rounding; and the layer's PyTorch path computes the same function."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import cpu_extension, int8_ops
from worker.quantization import int8_weights
from worker.quantization.int8_weights import Int8Linear, pack_int8, quantize_activations, quantize_weight

DTYPES = [torch.float32, torch.bfloat16]
ROWS = (1, 3, 8, 9, 130, 300)


def cpu_has_vnni() -> bool:
    return "avx512_vnni" in cpu_extension._cpu_flags().split()


def needs_int8_kernel() -> None:
    if cpu_extension.expected():
        cpu_extension.require()  # a failed build fails the test, never skips it
    if not int8_ops.int8_linear_available():
        assert not (cpu_extension.expected() and cpu_has_vnni()), "the VNNI kernel should run on this CPU"
        pytest.skip("the int8 kernel needs AVX512-VNNI and a compiler")


def reference(x, q, w_scale, bias, gated):
    """Quantize x per token, int32 product, epilogue in float32, one rounding to x's dtype."""
    y = int8_weights.int8_matmul_reference(x, q, w_scale, bias)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [37, 64, 515])
def test_quantize_rows_is_the_reference_quantization(dtype, k):
    needs_int8_kernel()
    g = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10).to(dtype)
        x[0] = 0  # a zero row: u8 0, scale 0, zero point 0
        if rows > 2:
            x[1] = x[1].abs()  # all positive: the range starts at 0, zero point 0
            x[2] = -x[2].abs()  # all negative: zero point 255
        u8, scale, zero = int8_ops.int8_quantize_rows(x)
        u8_ref, scale_ref, zero_ref = quantize_activations(x)
        assert u8.dtype == torch.uint8 and torch.equal(u8, u8_ref)
        assert torch.equal(scale, scale_ref) and torch.equal(zero, zero_ref)
        assert int(u8[0].max()) == 0 and float(scale[0]) == 0 and int(zero[0]) == 0
        if rows > 2:
            assert int(zero[1]) == 0 and int(u8[1].max()) == 255
            assert int(zero[2]) == 255 and int(u8[2].min()) == 0
        # Rows of both signs span the 8 bits; every row comes back to within half a step.
        assert torch.all(u8[3:].amax(dim=-1).int() - u8[3:].amin(dim=-1).int() >= 254)
        back = (u8.float() - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
        assert torch.all((back - x.float()).abs() <= scale.unsqueeze(-1) * 0.5001)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("k,n", [(37, 40), (130, 100), (64, 16)])
def test_int32_products_are_exact(gated, k, n):
    """Integer x whose rows span -128..127 quantize to u8 = x + 128 with scale 1; with unit weight
    scales and float32 output, y is the int32 product itself (below 2^24: exact in float32)."""
    needs_int8_kernel()
    g = torch.Generator().manual_seed(k * n)
    q = torch.randint(-127, 128, (2 * n if gated else n, k), generator=g, dtype=torch.int8)
    ones = torch.ones(q.shape[0])
    layer = Int8Linear(q, ones, gated=gated, use_kernel=True)
    for rows in ROWS:
        x = torch.randint(-128, 128, (rows, k), generator=g).float()
        x[:, 0], x[:, 1] = 127, -128
        acc = torch._int_mm(x.to(torch.int8), q.t()).double()
        if not gated:
            assert torch.equal(layer.linear(x, None).double(), acc)
        else:  # the gated epilogue's silu in float32 on exact products
            gate, up = acc.chunk(2, dim=-1)
            expected = F.silu(gate) * up
            got = layer.linear_silu(x, None).double()
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k,n", [(37, 40), (129, 100), (576, 48)])
def test_int8_linear_matches_reference(dtype, gated, with_bias, k, n):
    needs_int8_kernel()
    g = torch.Generator().manual_seed(k + n + gated)
    weight = torch.randn(2 * n if gated else n, k, generator=g) * torch.rand(2 * n if gated else n, 1, generator=g)
    q, w_scale = quantize_weight(weight.to(dtype))
    bias = torch.randn(q.shape[0], generator=g).to(dtype) if with_bias else None
    kernel = Int8Linear(q, w_scale, gated=gated, use_kernel=True)
    plain = Int8Linear(q, w_scale, gated=gated, use_kernel=False)
    for rows in ROWS:
        x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
        expected = reference(x, q, w_scale, bias, gated)
        for layer in (kernel, plain):
            got = layer.linear_silu(x, bias) if gated else layer.linear(x, bias)
            assert got.dtype == dtype and got.shape == (rows, n)
            if dtype == torch.bfloat16:  # one rounding of nearly the same float32: one bf16 step apart at most
                assert torch.all((got.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7 + 1e-5)
            else:
                assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    batched = (torch.randn(2, 3, k, generator=g)).to(dtype)
    fn = kernel.linear_silu if gated else kernel.linear
    assert torch.equal(fn(batched, bias), fn(batched.reshape(6, k), bias).reshape(2, 3, n))
    assert fn(batched[:0], bias).shape == (0, 3, n)


def test_weight_quantization_is_symmetric_per_channel():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [2.0, 1.0, -0.01]])
    q, scale = quantize_weight(weight)
    assert torch.equal(scale, torch.tensor([1.0 / 127, 1.0, 2.0 / 127]))
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -1]]
    assert torch.allclose(q.float() * scale[:, None], weight, atol=scale.max().item() / 2)


def test_gated_packing_pairs_gate_and_up_panels():
    q = torch.arange(2 * 40 * 8).reshape(80, 8).remainder(251).sub(125).to(torch.int8)
    packed = pack_int8(q, gated=True)
    gate, up = pack_int8(q[:40], gated=False), pack_int8(q[40:], gated=False)
    assert packed.shape == (6, 2, 16, 4)
    assert torch.equal(packed, torch.cat([gate[:2], up[:2], gate[2:], up[2:]]))


def test_int8_linear_rejects_mismatched_arguments():
    needs_int8_kernel()
    q = torch.randint(-127, 128, (40, 36), dtype=torch.int8)
    layer = Int8Linear(q, torch.ones(40), gated=False, use_kernel=True)
    with pytest.raises(RuntimeError, match="last dimension"):
        layer.linear(torch.randn(2, 44), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        layer.linear(torch.randn(2, 36).half(), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        layer.linear(torch.randn(2, 36), torch.zeros(41))
    with pytest.raises(RuntimeError, match="out_features"):
        int8_ops.int8_linear(torch.randn(2, 36), layer.packed, layer.scale, layer.col_sum, 60, None)
