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

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")
# Scalings whose `factor` multiplies the usable context (vLLM derives max_model_len so).
CONTEXT_STRETCHING_ROPE_TYPES = ("linear", "dynamic")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one flat dict with `rope_type` and `rope_theta`.

    transformers >= 5 keeps them in `rope_parameters`; older configs use
    `rope_scaling` (with `type` or `rope_type`) plus a top-level `rope_theta`.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":  # Phi-3's early name for longrope (transformers renames it too)
        params["rope_type"] = "longrope"
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    if params["rope_type"] in ("llama3", "longrope"):
        # Phi-3 configs keep the pretraining length at the top level (transformers prefers it there).
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
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


def longrope_inv_freqs(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(short, long) LongRoPE frequencies: the plain ones divided per frequency by
    `short_factor` / `long_factor`, in transformers' expression 1 / (factor * base^(2i/dim))."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    freqs = []
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if factors is None or len(factors) != dim // 2:
            raise ValueError(f"longrope needs `{key}` with {dim // 2} numbers (rotary dim {dim} / 2), "
                             f"got {None if factors is None else len(factors)}")
        freqs.append(1.0 / (torch.tensor(factors, dtype=torch.float32) * params["rope_theta"] ** shape))
    return freqs[0], freqs[1]


def longrope_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """The cos/sin multiplier: `attention_factor`, else sqrt(1 + ln(factor) / ln(original length))
    with `factor` (default: max_position_embeddings / original length), 1 when not stretched."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding:
    """cos/sin lookup by position plus the rotation itself.

    `rotary_dim` (head_dim x partial_rotary_factor) is how many leading features of each
    head rotate; the table rows have that width and `apply_rotary` passes the rest through.
    LongRoPE takes one set of factors for every position, by the longest sequence served
    (see set_max_model_len)."""

    def __init__(self, hf_config: Any, head_dim: int, *, partial_rotary: bool = False):
        """`partial_rotary`: whether the architecture rotates only part of a head when the config
        says so (transformers' Phi3 does; its Llama/Qwen code would ignore or fail on it)."""
        params = rope_parameters(hf_config)
        self.rope_type: str = params["rope_type"]
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        factor = float(params["partial_rotary_factor"])
        if factor != 1.0 and not partial_rotary:
            raise ValueError(f"partial_rotary_factor {factor} is not supported for this architecture "
                             "(only Phi3ForCausalLM rotates part of each head)")
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
        self.rotary_dim = int(head_dim * factor)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim {head_dim} x partial_rotary_factor "
                             f"{factor}) must be even and positive")
        self.head_dim = head_dim
        self.params = params
        self.max_position_embeddings: int = hf_config.max_position_embeddings
        self.inv_freq = base_inv_freq(params["rope_theta"], self.rotary_dim)
        self.attention_scaling = 1.0  # multiplies cos and sin (LongRoPE's attention factor)
        if self.rope_type == "linear":
            self.inv_freq = self.inv_freq / params["factor"]
        elif self.rope_type == "llama3":
            self.inv_freq = llama3_inv_freq(self.inv_freq, params)
        elif self.rope_type == "longrope":
            self.short_inv_freq, self.long_inv_freq = longrope_inv_freqs(params, self.rotary_dim)
            self.attention_scaling = longrope_attention_factor(params, self.max_position_embeddings)
        self.long_factors = False  # LongRoPE: whether the long factors are in use
        self._cos = self._sin = torch.empty(0)
        self.set_max_model_len(self.max_position_embeddings)

    def set_max_model_len(self, max_model_len: int) -> None:
        """LongRoPE as vLLM applies it: the long factors for every position of every sequence when
        sequences may grow past original_max_position_embeddings, else the short ones. transformers
        picks by the current length and, once a sequence crosses that length, recomputes its whole
        cache with the long factors; here a sequence that stays below it (max_model_len at most the
        original length) or starts above it (a longer prompt) gets transformers' exact rotations.
        Call before `reserve` (it drops the table); the model's default is max_position_embeddings."""
        if self.rope_type != "longrope":
            return
        self.long_factors = max_model_len > self.params["original_max_position_embeddings"]
        self.inv_freq = self.long_inv_freq if self.long_factors else self.short_inv_freq
        self._cos = self._sin = torch.empty(0)

    def reserve(self, length: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Make the table cover positions [0, length) in `dtype` on `device` (grows by doubling)."""
        device = torch.device(device)
        if self._cos.shape[0] < length or self._cos.dtype != dtype or self._cos.device != device:
            self._build_table(max(length, 2 * self._cos.shape[0], 256), dtype, device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, rotary_dim] for `positions` [T] from the reserved table."""
        return self._cos[positions], self._sin[positions]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, rotary_dim] for `positions` [T], in `dtype` on positions' device.
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
        self._cos = (emb.cos() * self.attention_scaling).to(device=device, dtype=dtype)
        self._sin = (emb.sin() * self.attention_scaling).to(device=device, dtype=dtype)

    def _dynamic_inv_freq(self, length: int) -> torch.Tensor:
        """Dynamic NTK: inside the trained context the plain frequencies; beyond it, position p
        uses the base transformers picks when p is the newest token (sequence length p + 1).
        (transformers rescales a whole forward call by its longest position, so a prompt that
        alone overflows the context gets slightly different keys there; decoding agrees.)"""
        max_pos = self.max_position_embeddings
        table = self.inv_freq[None, :].repeat(length, 1)
        if length > max_pos:
            factor, dim = self.params["factor"], self.rotary_dim
            seq_len = torch.arange(max_pos + 1, length + 1, dtype=torch.int64)
            base = self.params["rope_theta"] * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
            table[max_pos:] = base_inv_freq(base[:, None], dim)
        return table


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by per-token cos/sin [T, R], in x's dtype like transformers;
    with R < D (partial rotary) the first R features rotate and the rest pass through."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)
