"""The W8A8 kernel's AMX-INT8 path (worker/csrc/int8_amx.h) against its VNNI loop: integer sums are
exact, so both give the same bits (float32 and bfloat16, gated and not, with and without bias,
K with a tail of fewer than 16 steps), and both stay at the dequantized reference. Runs only where
the CPU has AMX-INT8 and the OS grants the tiles; elsewhere the tests skip."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import cpu_extension, int8_ops
from worker.quantization import int8_weights
from worker.quantization.int8_weights import column_sums, pack_int8, quantize_weight

NEVER = 1 << 62  # a row threshold no batch reaches: the VNNI loop
ROWS = (16, 17, 31, 64, 100, 257)


@pytest.fixture(autouse=True)
def _amx():
    if cpu_extension.expected():
        cpu_extension.require()  # a failed build fails the test, never skips it
    if not int8_ops.int8_amx_available():
        pytest.skip("no AMX-INT8 tiles here (or the kernels are not built)")


def _weights(k: int, n: int, gated: bool, dtype: torch.dtype, with_bias: bool, g: torch.Generator):
    rows = 2 * n if gated else n
    weight = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g)
    q, scale = quantize_weight(weight.to(dtype))
    bias = torch.randn(rows, generator=g).to(dtype) if with_bias else None
    return q, scale, pack_int8(q, gated=gated), column_sums(q), bias


def _run(x, packed, scale, col_sum, n, bias, gated, rows_threshold):
    fn = int8_ops.int8_linear_silu if gated else int8_ops.int8_linear
    with int8_ops.amx_rows(rows_threshold):
        return fn(x, packed, scale, col_sum, n, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("k", [64, 576, 1536, 100])
def test_amx_gives_the_vnni_bits(dtype, gated, k):
    """K = 100: 25 steps, one whole tile and a tail of 9 steps."""
    g = torch.Generator().manual_seed(k + gated)
    for n in (16, 48, 576):
        for with_bias in (False, True):
            q, scale, packed, col_sum, bias = _weights(k, n, gated, dtype, with_bias, g)
            for rows in ROWS:
                x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
                amx = _run(x, packed, scale, col_sum, n, bias, gated, 1)
                vnni = _run(x, packed, scale, col_sum, n, bias, gated, NEVER)
                assert amx.dtype == dtype and amx.shape == (rows, n)
                assert torch.equal(amx, vnni), (n, with_bias, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_amx_matches_the_dequantized_reference(dtype, gated):
    g = torch.Generator().manual_seed(7 + gated)
    k, n = 100, 48
    q, scale, packed, col_sum, bias = _weights(k, n, gated, dtype, True, g)
    for rows in (1, 8, 33, 257):  # one row stays on VNNI whatever the threshold: 1 forces every batch
        x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
        expected = int8_weights.int8_matmul_reference(x, q, scale, bias)
        if gated:
            gate, up = expected.chunk(2, dim=-1)
            expected = F.silu(gate) * up
        got = _run(x, packed, scale, col_sum, n, bias, gated, 1).float()
        if dtype == torch.bfloat16:  # one rounding of nearly the same float32
            assert torch.all((got - expected).abs() <= expected.abs() * 2 ** -7 + 1e-5)
        else:
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_exact_integer_products_on_tiles():
    """Integer x spanning -128..127 quantizes to u8 = x + 128 with scale 1: with unit weight scales
    and float32 output, y is the int32 product itself (below 2^24, exact in float32)."""
    g = torch.Generator().manual_seed(3)
    k, n = 1540, 40  # 385 steps: 24 tiles and a tail of 1 step
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    x = torch.randint(-128, 128, (64, k), generator=g).float()
    x[:, 0], x[:, 1] = 127, -128
    got = _run(x, pack_int8(q, gated=False), torch.ones(n), column_sums(q), n, None, False, 1)
    assert torch.equal(got.double(), torch._int_mm(x.to(torch.int8), q.t()).double())


def test_the_switch_keeps_every_batch_on_vnni():
    """PAGEDSERVE_INT8_AMX=0, read once at load: no batch size reaches the tiles."""
    script = ("from worker.kernels import cpu_extension; m = cpu_extension.require(); "
              "print(m.set_int8_amx_rows(8), m.set_int8_amx_rows(8))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for value, first in (("0", NEVER), ("1", None)):
        env = {**os.environ, "PAGEDSERVE_INT8_AMX": value}
        out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                             timeout=300, check=True).stdout.split()
        assert int(out[1]) == 8
        assert int(out[0]) >= NEVER if first else int(out[0]) < 1000
