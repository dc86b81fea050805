"""Linear layers on CPU with their weights pre-packed for the kernel extension's
matmul, `pagedserve::packed_linear` (see worker/csrc/packed_linear.cpp): bfloat16 on
CPUs with AVX512-BF16, float32 on any AVX-512 CPU. On CPUs with AMX, bfloat16 matmuls of
many rows (prefill chunks, large decode batches) go to PyTorch's oneDNN matmul instead.

A weight [N, K] is packed once at load time into panels of 16 output columns,
[ceil(N / 16), ceil(K / unit), 16, unit] (zero-padded), where a unit is the K
values one step of the kernel consumes: a pair in bfloat16 (one 64-byte load
feeds `vdpbf16ps` with 16 columns of a pair of K), one value in float32. The
packed copy is an ordinary tensor: compiled graphs take it as an input like any
weight. A uint8 packed copy holds GGUF quantized blocks (`pagedserve::gguf_linear`).
Where the kernel is not available (no compiler, no AVX-512, float16,
other devices) layers keep F.linear. The int8 method (worker.quantization) puts an object
with its own `linear(x, bias)` and `linear_silu(x, bias)` in place of the packed tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.kernels import cpu_ops

# On AMX CPUs the packed bfloat16 ops also get the plain weight, which they multiply through
# PyTorch (oneDNN's AMX tiles) from 16 rows on, and the GGUF ops dequantize theirs for that from
# 64 rows on (see worker/csrc/packed_linear.cpp, gguf_linear.cpp).
_DENSE_BF16 = cpu_ops.amx_bf16_available()

PANEL = 16  # output columns per panel (one AVX-512 register of float32)
GATED_BLOCK = 2  # gate panels per block of a gated packing (GATED_PANELS / 2 in the C++ source)


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2
            and cpu_ops.packed_linear_available(weight.dtype))


def step_unit(dtype: torch.dtype) -> int:
    """K values per step of the packed kernel: bf16 pairs, single floats."""
    return 2 if dtype == torch.bfloat16 else 1


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of `weight` [N, K], or None when the kernel cannot run it."""
    if not packing_supported(weight):
        return None
    return panels(weight, step_unit(weight.dtype))


def panels(weight: torch.Tensor, unit: int) -> torch.Tensor:
    """`weight` [N, K] of any dtype as [ceil(N / 16), ceil(K / unit), 16, unit], zero-padded."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, -k % unit, 0, -n % PANEL))
    return (padded.view(padded.shape[0] // PANEL, PANEL, padded.shape[1] // unit, unit)
            .permute(0, 2, 1, 3).contiguous())


def pack_gated(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a fused gate/up weight [2N, K] (gate rows, then up rows) for
    `pagedserve::packed_linear_silu`: panels in blocks of two gate panels followed by the
    up panels of the same columns (the last block may hold one of each), so that one
    register tile holds both factors of its outputs. None when the kernel cannot run it."""
    if not packing_supported(weight) or weight.shape[0] % 2:
        return None
    n = weight.shape[0] // 2
    gate, up = pack_weight(weight[:n]), pack_weight(weight[n:])
    blocks = []
    for first in range(0, gate.shape[0], GATED_BLOCK):
        blocks += [gate[first:first + GATED_BLOCK], up[first:first + GATED_BLOCK]]
    return torch.cat(blocks)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed copy of weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, torch.Tensor):  # a quantized weight multiplies itself
        return packed.linear(x, bias)
    if packed.dtype == torch.uint8:  # GGUF quantized blocks (worker.quantization.gguf_packing)
        return torch.ops.pagedserve.gguf_linear(x, packed, weight.shape[0], bias, _DENSE_BF16)
    dense = weight if _DENSE_BF16 and packed.dtype == torch.bfloat16 else None
    return torch.ops.pagedserve.packed_linear(x, packed, weight.shape[0], bias, dense)


def linear_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection F.linear(x, weight, bias) (gate columns
    first), in one pass through the gated packed copy (`pack_gated`) when there is one."""
    if packed is None:
        gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    if not isinstance(packed, torch.Tensor):
        return packed.linear_silu(x, bias)
    if packed.dtype == torch.uint8:
        return torch.ops.pagedserve.gguf_linear_silu(x, packed, weight.shape[0] // 2, bias, _DENSE_BF16)
    dense = weight if _DENSE_BF16 and packed.dtype == torch.bfloat16 else None
    return torch.ops.pagedserve.packed_linear_silu(x, packed, weight.shape[0] // 2, bias, dense)
