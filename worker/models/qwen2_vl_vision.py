"""The Qwen2-VL and Qwen2.5-VL vision encoders in plain torch, as transformers computes them.

Input: the processor's patch rows of a step's images, concatenated ([sum t*h*w, C*T*P*P]), and
each image's patch grid (t, h, w). The patch embedding (a Conv3d whose kernel is the whole
patch) is one matmul; the blocks use 2-D rotary (height, width) and attend within each image
(Qwen2.5-VL: within windows, except the `fullatt_block_indexes` blocks); the PatchMerger turns
each merge_size x merge_size group into one embedding row of the text model's width.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.rotary import rotate_half


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm (float32 inside, like the text model's)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class VisionMlp(nn.Module):
    """fc1 -> act -> fc2 (Qwen2-VL), or the gated gate/up -> down with biases (Qwen2.5-VL)."""

    def __init__(self, dim: int, hidden: int, act: str, gated: bool):
        super().__init__()
        from transformers.activations import ACT2FN

        self.act = ACT2FN[act]
        self.gated = gated
        if gated:
            self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
            self.down_proj = nn.Linear(hidden, dim)
        else:
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q, k = (((t.float() * cos) + (rotate_half(t.float()) * sin)).to(t.dtype) for t in (q, k))
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # attention within each segment
            segment = [t[start:end].transpose(0, 1) for t in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*segment).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, qwen25: bool):
        super().__init__()
        norm = (lambda: VisionRMSNorm(dim)) if qwen25 else (lambda: nn.LayerNorm(dim, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMlp(dim, mlp_hidden, act, gated=qwen25)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, qwen25: bool):
        super().__init__()
        self.hidden = dim * merge ** 2
        self.ln_q = VisionRMSNorm(dim) if qwen25 else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class QwenVisionEncoder(nn.Module):
    """`vision_config`: Qwen2VLVisionConfig (qwen25 False) or Qwen2_5_VLVisionConfig."""

    def __init__(self, vision_config: Any, qwen25: bool):
        super().__init__()
        c = vision_config
        self.qwen25 = qwen25
        dim = c.hidden_size if qwen25 else c.embed_dim
        out_dim = c.out_hidden_size if qwen25 else c.hidden_size
        mlp_hidden = c.intermediate_size if qwen25 else int(c.embed_dim * c.mlp_ratio)
        self.merge = c.spatial_merge_size
        self.patch_size = c.patch_size
        self.window_size = getattr(c, "window_size", 0)
        self.full_attention_blocks = set(getattr(c, "fullatt_block_indexes", None) or [])
        self.patch_embed = nn.Linear(c.in_channels * c.temporal_patch_size * c.patch_size ** 2, dim, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(dim, c.num_heads, mlp_hidden, c.hidden_act, qwen25)
                                    for _ in range(c.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, qwen25)
        head_dim = dim // c.num_heads
        theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / (theta ** quarter), persistent=False)

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's vision tensors under this module's names (the Conv3d kernel flattened)."""
        weight = state.get("patch_embed.proj.weight")
        state = {k: v for k, v in state.items() if k != "patch_embed.proj.weight"}
        if weight is not None:
            state["patch_embed.weight"] = weight.reshape(weight.shape[0], -1)
        return state

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """[sum t*h*w, C*T*P*P] -> [sum t*h*w / merge^2, out_dim], images in order."""
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        cos, sin = self._rotary(grids, x.device)
        full = self._cu_seqlens([h * w for t, h, w in grids for _ in range(t)])
        order = None
        if self.qwen25:  # rows regrouped window by window (in merge units), restored after the merger
            order, windows = self._window_order(grids)
            unit = self.merge ** 2
            x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
            cos, sin = (t.view(-1, unit, t.shape[-1])[order].reshape(t.shape) for t in (cos, sin))
        cos, sin = cos[:, None, :], sin[:, None, :]
        for index, block in enumerate(self.blocks):
            use_full = not self.qwen25 or index in self.full_attention_blocks
            x = block(x, cos, sin, full if use_full else windows)
        merged = self.merger(x)
        return merged if order is None else merged[torch.argsort(order)]

    def _rotary(self, grids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin [N, head_dim] of each patch's (row, column), rows in merge-block order."""
        m = self.merge
        ids = []
        for t, h, w in grids:
            hpos = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
            wpos = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
            ids.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
        freqs = torch.cat(ids).to(device)[..., None].float() * self.inv_freq.to(device)  # [N, 2, hd/4]
        freqs = freqs.flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def _cu_seqlens(lengths: list[int]) -> list[int]:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        return bounds

    def _window_order(self, grids: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows: the merge units of each window_size-pixel square, window by
        window (transformers' get_window_index); (unit order, patch bounds of the windows)."""
        side = self.window_size // self.merge // self.patch_size
        order, bounds, base = [], [0], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).view(t, gh, gw)
            pad_h, pad_w = -gh % side, -gw % side
            padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
            nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
            padded = padded.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
            for window in padded:
                units = window[window >= 0]
                if units.numel():
                    order.append(units + base)
                    bounds.append(bounds[-1] + units.numel() * self.merge ** 2)
            base += t * gh * gw
        return torch.cat(order), bounds
