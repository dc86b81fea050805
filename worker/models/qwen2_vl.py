"""Qwen2-VL and Qwen2.5-VL: the vision encoder (worker.models.qwen2_vl_vision) in front of our
Qwen2 text decoder with M-RoPE (worker.models.mrope).

`encode_images` runs at prefill, once per image; its rows replace the placeholder tokens'
embeddings (worker.image_embeddings). The text model is a plain Qwen2's but for its rotary,
which also takes [3, T] positions. Checkpoint names: transformers >= 4.52 / 5.x
(`model.language_model.*`, `model.visual.*`) and older (`model.*`, `visual.*`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from common.errors import ConfigError
from common.parallel_layout import TensorShard
from worker.models.mrope import MRotaryEmbedding
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen2_vl_vision import QwenVisionEncoder

_TEXT_PREFIXES = (("model.language_model.", "model."),)
_VISION_PREFIXES = ("model.visual.", "visual.")


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """`config` (what the KV cache is sized by) is the text config; the whole one is
    `vision_language_config`. `mrope_merge_size`: the worker gives such models M-RoPE positions."""

    qwen25 = False

    def __init__(self, hf_config: Any, *, dtype: torch.dtype | None = None, device: Any = None,
                 shard: TensorShard = TensorShard(), stage: tuple[int, int] = (0, 1)):
        if shard.size > 1 or stage[1] > 1:
            raise ConfigError(f"{type(self).__name__} runs on one worker rank only (no tensor or pipeline parallelism)")
        text_config = getattr(hf_config, "text_config", None) or hf_config
        if getattr(hf_config, "tie_word_embeddings", False):
            text_config.tie_word_embeddings = True
        super().__init__(text_config, dtype=dtype, device=device, shard=shard, stage=stage)
        self.vision_language_config = hf_config
        self.image_token_id = int(hf_config.image_token_id)
        self.vision = QwenVisionEncoder(hf_config.vision_config, self.qwen25).to(dtype=self.dtype, device=self.device)
        self.vision.eval()
        self.mrope_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.rotary = MRotaryEmbedding(text_config, self.sizes.head_dim)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: dict[str, torch.Tensor] = {}
        super().load_weights(self._split(weights, vision))
        state = self.vision.checkpoint_state(vision)
        expected = set(self.vision.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {type(self).__name__} vision encoder: "
                             f"missing {missing[:5]} unexpected {unexpected[:5]}")
        self.vision.load_state_dict(state, strict=True)

    @staticmethod
    def _split(weights: Iterable[tuple[str, torch.Tensor]], vision: dict[str, torch.Tensor]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The text model's tensors under a plain Qwen2's names; the vision ones into `vision`."""
        for name, tensor in weights:
            prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                vision[name[len(prefix):]] = tensor
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            yield name, tensor

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """Patch rows of images [sum t*h*w, C*T*P*P] and their grids -> [sum of their
        placeholder counts, hidden], images in order (transformers' get_image_features)."""
        return self.vision(pixel_values.to(device=self.device), grid_thw)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """RMSNorm and gated-MLP vision blocks, window attention but in `fullatt_block_indexes`."""

    qwen25 = True
