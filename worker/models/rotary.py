"""Rotary position embeddings computed exactly as transformers does (HF "rotate_half" layout).

cos/sin for every position are kept in a table that grows on demand; each row
holds the same float32 values transformers computes for that position
(position * inv_freq, duplicated across both halves, cos/sin, then cast to the
model dtype), so a lookup by position replaces the per-step trigonometry.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# Scalings whose `factor` multiplies the usable context (vLLM derives max_model_len so).
CONTEXT_STRETCHING_ROPE_TYPES = ("linear", "dynamic")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one flat dict with `rope_type` and `rope_theta`.

    transformers >= 5 keeps them in `rope_parameters`; older configs use
    `rope_scaling` (with `type` or `rope_type`) plus a top-level `rope_theta`.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def base_inv_freq(base: float | torch.Tensor, dim: int) -> torch.Tensor:
    """1 / base^(2i/dim) in float32, the same expression transformers uses."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (base ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth ramp in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin lookup by position plus the rotation itself."""

    def __init__(self, hf_config: Any, head_dim: int):
        params = rope_parameters(hf_config)
        self.rope_type: str = params["rope_type"]
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        self.head_dim = head_dim
        self.params = params
        self.max_position_embeddings: int = hf_config.max_position_embeddings
        self.inv_freq = base_inv_freq(params["rope_theta"], head_dim)
        if self.rope_type == "linear":
            self.inv_freq = self.inv_freq / params["factor"]
        elif self.rope_type == "llama3":
            self.inv_freq = llama3_inv_freq(self.inv_freq, params)
        self._cos = self._sin = torch.empty(0)

    def reserve(self, length: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Make the table cover positions [0, length) in `dtype` on `device` (grows by doubling)."""
        device = torch.device(device)
        if self._cos.shape[0] < length or self._cos.dtype != dtype or self._cos.device != device:
            self._build_table(max(length, 2 * self._cos.shape[0], 256), dtype, device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, head_dim] for `positions` [T] from the reserved table."""
        return self._cos[positions], self._sin[positions]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, head_dim] for `positions` [T], in `dtype` on positions' device.
        `max_seq_len` (> every position) spares a device sync to find the largest position."""
        if max_seq_len is not None:
            needed = max_seq_len
        else:
            needed = int(positions.max()) + 1 if positions.numel() else 0
        self.reserve(needed, dtype, positions.device)
        return self.lookup(positions)

    def _build_table(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(length, dtype=torch.int64).float()
        if self.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(length)
        else:
            inv_freq = self.inv_freq[None, :].expand(length, -1)
        freqs = positions[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(device=device, dtype=dtype)
        self._sin = emb.sin().to(device=device, dtype=dtype)

    def _dynamic_inv_freq(self, length: int) -> torch.Tensor:
        """Dynamic NTK: inside the trained context the plain frequencies; beyond it, position p
        uses the base transformers picks when p is the newest token (sequence length p + 1).
        (transformers rescales a whole forward call by its longest position, so a prompt that
        alone overflows the context gets slightly different keys there; decoding agrees.)"""
        max_pos = self.max_position_embeddings
        table = self.inv_freq[None, :].repeat(length, 1)
        if length > max_pos:
            factor, dim = self.params["factor"], self.head_dim
            seq_len = torch.arange(max_pos + 1, length + 1, dtype=torch.int64)
            base = self.params["rope_theta"] * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
            table[max_pos:] = base_inv_freq(base[:, None], dim)
        return table


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by per-token cos/sin [T, D], in x's dtype like transformers."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)
