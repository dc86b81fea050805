"""M-RoPE (Qwen2-VL): 3-D rotary positions (temporal, height, width) for the text decoder.

A prompt's text tokens have one position on all three axes; an image's placeholder tokens
have their (t, h, w) place on the image's merged grid, offset by where the image starts, and
the text after an image continues from its largest position + 1 (transformers' get_rope_index).
Past the prompt every axis is the token's index + the request's `delta` (that largest
position + 1 - prompt length), so decode steps need only 1-D positions; a step takes [3, T]
positions only while it computes image placeholders.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common.protocol import ImageInput
from worker.models.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """The text rotary table, looked up per axis for [3, T] positions: the frequencies of
    `mrope_section` (halves of the rotary dim) come from the temporal, height, width axes."""

    def __init__(self, hf_config: Any, head_dim: int):
        super().__init__(hf_config, head_dim)
        section = list(self.params.get("mrope_section") or [])
        if sum(section) != self.rotary_dim // 2 or len(section) != 3:
            raise ValueError(f"mrope_section {section} must be 3 numbers summing to half the rotary dim "
                             f"({self.rotary_dim // 2})")
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(section * 2)])
        self.axis_of_dim = axis  # which axis's position each rotary feature takes

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions)
        index = self.axis_of_dim.to(positions.device)[None, None, :].expand(1, positions.shape[1], -1)
        return tuple(table[positions].gather(0, index).squeeze(0) for table in (self._cos, self._sin))


def prompt_mrope_positions(num_prompt_tokens: int, images: list[ImageInput], merge_size: int
                           ) -> tuple[np.ndarray, int]:
    """([3, num_prompt_tokens] int64 positions, delta) of a prompt with these images."""
    positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
    index = next_position = 0  # where the next text run starts in the prompt, and its position
    for image in images:
        text = image.offset - index
        positions[:, index:image.offset] = np.arange(next_position, next_position + text)
        start = next_position + text
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge_size, image.grid_thw[2] // merge_size
        if t * h * w != image.length:
            raise ValueError(f"an image of grid {image.grid_thw} (merge {merge_size}) has {t * h * w} tokens, "
                             f"not its {image.length} placeholders")
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        positions[:, image.offset:image.offset + image.length] = grid + start
        next_position = start + max(t, h, w)
        index = image.offset + image.length
    positions[:, index:] = np.arange(next_position, next_position + num_prompt_tokens - index)
    delta = int(positions.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
    return positions, delta


def step_mrope_positions(positions: np.ndarray, rows: list[tuple[Any, int, int, int]], three_d: bool) -> np.ndarray:
    """The rotary positions of a step from its token indexes `positions` [T]: for each M-RoPE
    request's rows (state, first row, first token, tokens), its prompt positions, then index +
    delta. [3, T] when `three_d` (image placeholders in the step), else [T]."""
    out = np.repeat(positions[None], 3, axis=0)
    for state, start, context, n in rows:
        table = state.mrope_positions
        k = max(0, min(n, table.shape[1] - context))  # prompt tokens in this chunk
        out[:, start:start + k] = table[:, context:context + k]
        out[:, start + k:start + n] += state.mrope_delta
    return out if three_d else out[0]
