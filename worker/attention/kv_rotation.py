"""A Hadamard rotation of queries and keys for 8-bit float KV caches.

Attention scores are dot products q·k, which any orthogonal H leaves alone: (qH)·(kH) = q·k. So a
layer may store kH in its cache and attend with qH, and compute the same function. The keys a
cache holds come after the rotary embedding, whose low-frequency channels carry most of a key's
size and line up with the queries' large channels; rounding those few channels to 3 mantissa
bits (e4m3) costs most of an 8-bit cache's error. A Hadamard rotation spreads every channel over
all of them, so the rounding errors of a score average out instead of adding up in a few
channels. Values are not rotated (rounding V costs next to nothing).

Used for `--kv-cache-dtype fp8*` caches whose checkpoint gives no scales: checkpoint scales are
calibrated to the unrotated keys' range (docs/architecture.md).
"""
from __future__ import annotations

import torch

from worker.attention.fp8_kv import is_fp8


def hadamard(dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An orthogonal, symmetric [dim, dim] matrix: Sylvester Hadamard blocks of the largest power of
    two that divides dim (the whole of it for 64 or 128; three blocks of 32 for 96), each over
    sqrt(block)."""
    block = dim & -dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*[h / block ** 0.5] * (dim // block))
    return h.to(device=device, dtype=dtype)


def kv_rotations(kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 kv_scales: list[tuple[float, float]] | None) -> dict[int, torch.Tensor] | None:
    """head_dim -> the float32 rotation of the layers with that head size, when the caches are 8-bit
    floats without checkpoint scales; None otherwise (nothing is rotated)."""
    if not kv_caches or not is_fp8(kv_caches[0][0].dtype):
        return None
    if kv_scales is not None and any(scale != (1.0, 1.0) for scale in kv_scales):
        return None
    dims = {k_cache.shape[-1] for k_cache, _ in kv_caches}
    return {dim: hadamard(dim, torch.float32, kv_caches[0][0].device) for dim in dims}


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ rotation (float32), computed in float32 and rounded once to x's dtype."""
    return (x.float() @ rotation).to(x.dtype)
