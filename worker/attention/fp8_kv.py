"""The 8-bit float KV cache (`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`, as vLLM): element
types, and the conversions every backend and the reference share.

A layer's K and V each have one scale (vLLM's per-tensor `k_scale` / `v_scale`): the cache
stores real / scale, saturated to the format's largest finite value (NaN stays NaN) and rounded
to nearest even, and a read multiplies by the scale again. The scales are 1.0 unless the
checkpoint provides them.
"""
from __future__ import annotations

import torch

# --kv-cache-dtype names -> torch dtypes ("fp8" is e4m3, as vLLM).
FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved --kv-cache-dtype name (float32, bfloat16, float16 or an fp8 name)."""
    return FP8_KV_DTYPES.get(name) or getattr(torch, name)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: a plain cast, or for 8-bit caches x / scale saturated and rounded."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    largest = torch.finfo(cache_dtype).max
    scaled = x.float() / torch.tensor(scale, dtype=torch.float32, device=x.device)
    return scaled.clamp(-largest, largest).to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What the cache's elements stand for, in `dtype` (8-bit caches: times the scale, in float32 first)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def as_indexable(cache: torch.Tensor) -> torch.Tensor:
    """A view that index_copy_/index_select accept: 8-bit float tensors as uint8 (CPU torch has no
    indexing kernels for them); others as they are."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
