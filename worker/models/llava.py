"""LLaVA: transformers' own vision tower and projector in front of our Llama text model.

The vision part runs once per image at prefill (`encode_images`); its output rows replace the
embeddings of the image's placeholder tokens (`worker.image_embeddings`). Everything after the
embedding is the text model as served for a plain Llama, so text-only steps are unchanged.
Checkpoint names: transformers 4.x (`language_model.model.*`, `vision_tower.*`) and 5.x
(`model.language_model.*`, `model.vision_tower.*`) layouts are both read.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from common.errors import ConfigError
from common.parallel_layout import TensorShard
from worker.models.llama import LlamaForCausalLM

# checkpoint prefix -> what it becomes (None: the vision part, by its own prefix)
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = {"model.vision_tower.": "vision", "vision_tower.": "vision",
                    "model.multi_modal_projector.": "projector", "multi_modal_projector.": "projector"}


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """`config` (and what the worker sizes the KV cache by) is the text config; the full
    LlavaConfig is `vision_language_config`."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype | None = None, device: Any = None,
                 shard: TensorShard = TensorShard(), stage: tuple[int, int] = (0, 1)):
        if shard.size > 1 or stage[1] > 1:
            raise ConfigError("LLaVA models run on one worker rank only (no tensor or pipeline parallelism)")
        text_config = hf_config.text_config
        if getattr(text_config, "model_type", "llama") not in ("llama", "mistral"):
            raise ConfigError(f"LLaVA with a {text_config.model_type!r} text model is not supported (llama only)")
        super().__init__(text_config, dtype=dtype, device=device, shard=shard, stage=stage)
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.vision_language_config = hf_config
        self.image_token_id = int(hf_config.image_token_index)
        self.feature_layer = hf_config.vision_feature_layer
        self.select_strategy = hf_config.vision_feature_select_strategy
        self.vision_tower = AutoModel.from_config(hf_config.vision_config).to(dtype=self.dtype, device=self.device)
        self.projector = LlavaMultiModalProjector(hf_config).to(dtype=self.dtype, device=self.device)
        self.vision_tower.eval()
        self.projector.eval()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        parts: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "projector": {}}
        super().load_weights(self._split(weights, parts))
        self._load_part(self.vision_tower, parts["vision"], "vision tower")
        self._load_part(self.projector, parts["projector"], "multi_modal_projector")

    @staticmethod
    def _split(weights: Iterable[tuple[str, torch.Tensor]], parts: dict[str, dict[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The text model's tensors under a plain Llama's names; the others into `parts`."""
        for name, tensor in weights:
            for prefix, part in _VISION_PREFIXES.items():
                if name.startswith(prefix):
                    parts[part][name[len(prefix):]] = tensor
                    break
            else:
                for prefix, replacement in _TEXT_PREFIXES:
                    if name.startswith(prefix):
                        name = replacement + name[len(prefix):]
                        break
                yield name, tensor

    @staticmethod
    def _load_part(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
        expected = set(module.state_dict())
        if not set(state) <= expected:  # an older CLIPVisionModel layout: `vision_model.` in front
            state = {name.removeprefix("vision_model."): tensor for name, tensor in state.items()}
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the LLaVA {what}: missing {missing[:5]} "
                             f"unexpected {unexpected[:5]}")
        module.load_state_dict(state, strict=True)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, tokens per image, hidden]: the placeholder rows, as
        transformers' LlavaModel.get_image_features computes them."""
        out = self.vision_tower(pixel_values.to(dtype=self.dtype, device=self.device), output_hidden_states=True,
                                return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":
            selected = [h[:, 1:] for h in selected]
        return self.projector(torch.cat(selected, dim=-1))
