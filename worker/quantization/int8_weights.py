"""W8A8 linear layers (`--quantization int8`): int8 weights with symmetric per-output-channel
scales (made at load from a float checkpoint, or read from a compressed-tensors one), 8-bit
activations with dynamic asymmetric per-token scales and zero points, int32 products, and the
zero points, scales and bias applied after (y = (acc - zero * sum(w)) * x_scale * w_scale + bias,
in float32, rounded once to x's dtype). Asymmetric activations: each token's [min, max] in 255
steps rather than [-max|x|, max|x|] in 254; on SmolLM2-135M the symmetric scheme cost 2.6 %
perplexity against bf16, the asymmetric one 1.3 % (docs/benchmarks.md).

On CPUs with AVX512-VNNI the matmul is `pagedserve::int8_linear` (worker/csrc/int8_linear.cpp:
weights in panels of 16 columns x 4 K, activations as u8 with each column's weight sum precomputed);
elsewhere the same function in plain PyTorch (`torch._int_mm`: exact int32 products). A
layer's `Int8Linear` replaces its `<name>_packed` buffer: `worker.models.packed_linear.linear`
hands any non-tensor packing its own `linear` / `linear_silu`.

Under tensor parallelism each rank quantizes its own shard: column-parallel layers (qkv,
gate_up) hold whole output channels, so their scales are the unsharded model's; row-parallel
layers (o, down) hold a slice of each channel's inputs, so their channel scales (and the
activations' per-token scales) are over that slice, a finer grouping whose partial results are
summed in float after dequantizing. A compressed-tensors checkpoint's scales are the whole
channel's on every rank.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError
from worker.kernels import int8_ops
from worker.models.packed_linear import GATED_BLOCK, panels

logger = logging.getLogger(__name__)

UNIT = 4  # K values per step of the int8 kernel (one vpdpbusd)
# "0": the PyTorch path even where the kernel runs (the reference `bench accuracy --checks quantized` uses).
KERNEL_SWITCH = "PAGEDSERVE_INT8_KERNEL"
LAYER_WEIGHTS = ("qkv", "o", "gate_up", "down")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N]) with weight ~ q * scale[:, None]: symmetric per output
    channel, scale = max|row| / 127 (1 for a zero row), q = round(row / scale)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u8 [..., K], scale float32 [...], zero int32 [...]) with x ~ (u8 - zero) * scale: asymmetric
    per token over [min(x, 0), max(x, 0)], inv = 255 / (hi - lo) (0 for a zero row), zero =
    round(-lo * inv), u8 = clamp(round(x * inv) + zero, 0, 255), rounding to nearest even: what the
    kernel's `int8_quantize_rows` computes."""
    xf = x.to(torch.float32)
    lo = xf.amin(dim=-1).clamp(max=0)
    span = xf.amax(dim=-1).clamp(min=0) - lo
    steps = torch.full_like(span, 255.0)  # elementwise true divisions (torch divides by a scalar as a product)
    inv = torch.where(span > 0, steps / span, torch.zeros_like(span))
    zero = torch.round(-lo * inv).clamp_(0, 255)
    u8 = (torch.round(xf * inv.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp_(0, 255).to(torch.uint8)
    return u8, span / steps, zero.to(torch.int32)


def column_sums(q_weight: torch.Tensor) -> torch.Tensor:
    """int32 [N]: each output channel's sum of int8 weights (what the activations' zero points multiply)."""
    return q_weight.to(torch.int32).sum(dim=1).to(torch.int32)


def int8_matmul_reference(x: torch.Tensor, q_weight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, col_sum: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [..., N] = dequantized int32 product of x's quantization with q_weight [N, K]
    (`torch._int_mm` takes int8: u8 - 128, the difference to the zero point folded in after;
    `col_sum`: q_weight's column_sums, made here when not given)."""
    u8, x_scale, zero = quantize_activations(x)
    shifted = (u8.to(torch.int16) - 128).to(torch.int8).reshape(-1, u8.shape[-1])
    sums = column_sums(q_weight) if col_sum is None else col_sum
    acc = torch._int_mm(shifted, q_weight.t()) - (zero.reshape(-1, 1) - 128) * sums
    y = acc.to(torch.float32) * x_scale.reshape(-1, 1) * scale
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(*x.shape[:-1], q_weight.shape[0])


def pack_int8(q: torch.Tensor, gated: bool) -> torch.Tensor:
    """q [N, K] int8 as the kernel's panels [ceil(N / 16), ceil(K / 4), 16, 4]; gated (q the gates'
    rows then the ups'): blocks of GATED_BLOCK gate panels followed by the same columns' up panels,
    as `packed_linear.pack_gated` lays them out."""
    if not gated:
        return panels(q, UNIT)
    n = q.shape[0] // 2
    gate, up = panels(q[:n], UNIT), panels(q[n:], UNIT)
    blocks = []
    for first in range(0, gate.shape[0], GATED_BLOCK):
        blocks += [gate[first:first + GATED_BLOCK], up[first:first + GATED_BLOCK]]
    return torch.cat(blocks).contiguous()


class Int8Linear(nn.Module):
    """One W8A8 weight (gated: a fused gate/up weight whose output is silu(gate) * up), as the
    kernel's packing or, without the kernel, the int8 matrix for the PyTorch path."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, *, gated: bool, use_kernel: bool):
        super().__init__()
        self.out_features = q.shape[0] // 2 if gated else q.shape[0]
        self.gated = gated
        self.use_kernel = use_kernel
        self.register_buffer("scale", scale.to(torch.float32).contiguous(), persistent=False)
        self.register_buffer("col_sum", column_sums(q), persistent=False)
        if use_kernel:
            self.register_buffer("packed", pack_int8(q, gated), persistent=False)
            self.q = None
        else:
            self.register_buffer("q", q.contiguous(), persistent=False)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.use_kernel:
            return int8_ops.int8_linear(x, self.packed, self.scale, self.col_sum, self.out_features, bias)
        return int8_matmul_reference(x, self.q, self.scale, bias, self.col_sum).to(x.dtype)

    def linear_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.use_kernel:
            return int8_ops.int8_linear_silu(x, self.packed, self.scale, self.col_sum, self.out_features, bias)
        gate, up = int8_matmul_reference(x, self.q, self.scale, bias, self.col_sum).chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)


def check_int8_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """W8A8 runs on CPU with bfloat16 or float32 activations (ConfigError otherwise)."""
    if device.type != "cpu":
        raise ConfigError(f"--quantization int8 runs on CPU only, not {device.type}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"--quantization int8 takes --dtype bfloat16 or float32, not {str(dtype).split('.')[-1]}")


def quantize_model(model: Any, scales: dict[tuple[int, str], torch.Tensor] | None = None) -> bool:
    """Replace every decoder layer's four matmul weights by `Int8Linear`s and free the float
    weights. `scales` (a pre-quantized checkpoint's, by (layer position, weight name)): the
    layers' float weights hold the checkpoint's int8 values exactly, and these are their scales.
    Returns whether the VNNI kernel runs them (else the PyTorch path)."""
    check_int8_dtype(model.dtype, model.device)
    switched_off = os.environ.get(KERNEL_SWITCH, "1") == "0"
    use_kernel = not switched_off and int8_ops.int8_linear_available()
    if switched_off:
        logger.info("--quantization int8: %s=0, running the int8 matmuls in plain PyTorch", KERNEL_SWITCH)
    elif not use_kernel:
        logger.warning("--quantization int8: no AVX512-VNNI kernel on this CPU (or the CPU kernels are off); "
                       "running the int8 matmuls in plain PyTorch, which is much slower")
    for position, layer in enumerate(model.layers):
        for name in LAYER_WEIGHTS:
            weight = getattr(layer, name + "_weight")
            if scales is None:
                q, scale = quantize_weight(weight)
            else:
                q, scale = weight.detach().to(torch.int8), scales[(position, name)]
            setattr(layer, name + "_packed", Int8Linear(q, scale, gated=name == "gate_up", use_kernel=use_kernel))
            # The float weight is no longer read (the packing carries the shapes): keep an empty one.
            setattr(layer, name + "_weight", nn.Parameter(weight.new_empty((0, weight.shape[1])), requires_grad=False))
        layer.fused_rotary = use_kernel and _bf16_rotary_available() and model.rotary_kernel_fits()
    return use_kernel


def _bf16_rotary_available() -> bool:
    from worker.kernels import cpu_ops
    return cpu_ops.packed_linear_available(torch.bfloat16)


def prepare_int8(model: Any) -> str:
    """`quantize_model` from the float weights, or a compressed-tensors checkpoint's int8 values
    and scales (`model.checkpoint_scales`, see compressed_checkpoint); returns "int8"."""
    from worker.quantization import compressed_checkpoint
    saved = getattr(model, "checkpoint_scales", None)
    scales = compressed_checkpoint.layer_scales(model, saved) if saved is not None else None
    model.checkpoint_scales = None
    kernel = quantize_model(model, scales)
    logger.info("Quantized the decoder layers' linear weights to int8 (W8A8%s), multiplied by %s",
                ", the compressed-tensors checkpoint's values and scales" if scales is not None else "",
                "the AVX512-VNNI kernel" if kernel else "plain PyTorch")
    return "int8"
