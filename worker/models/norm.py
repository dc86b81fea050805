"""RMSNorm as transformers' LlamaRMSNorm computes it, and the same through the CPU
kernel extension (`pagedserve::rms_norm`, `pagedserve::add_rms_norm`; see
worker.cpu_norm_source): in bfloat16 the kernel's values are eager's (only the
order in which a row's squares add up differs), and a compiled graph calls it
instead of inductor's fused kernels, which cost several times as much on
decode-sized batches."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    """rms_norm(x), through the kernel when `fused`."""
    if fused:
        return torch.ops.pagedserve.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def add_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
             fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, its rms_norm), through the kernel when `fused`."""
    if fused:
        return torch.ops.pagedserve.add_rms_norm(residual, delta, weight, eps)
    hidden = residual + delta
    return hidden, rms_norm(hidden, weight, eps)
