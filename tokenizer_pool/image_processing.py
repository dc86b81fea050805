"""A prompt with images -> its token ids (each image's placeholders expanded) and the pixel
values, by the model's own processor from transformers (AutoProcessor from the model
directory; nothing is downloaded). The tokenizer pool and the offline LLM run this, so the
worker gets ready pixel tensors and only runs the vision encoder.

Qwen2-VL / Qwen2.5-VL: transformers' processor for them cannot load without torchvision (its
video processor needs it), so their image processor (the PIL one) and tokenizer run here and
each image's placeholder becomes grid t*h*w / merge_size^2 tokens, as Qwen2VLProcessor does.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from common.errors import ConfigError, InvalidRequestError
from common.protocol import ImageInput, TensorData

GRID_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # pixel patches + image_grid_thw per image


class ImagePromptProcessor:
    """Wraps the model's processor (LlavaProcessor and alike); `image_token` is the text a
    prompt marks each image's place with, `chat_image_text` what a chat's image part becomes."""

    def __init__(self, model_dir: str):
        self.grid_merge_size = 0  # Qwen2-VL style: the image processor's merge_size
        if _model_type(model_dir) in GRID_MODEL_TYPES:
            self._load_grid_processor(model_dir)
            return
        from transformers import AutoProcessor

        try:
            self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"the model in {model_dir} has no image processor: {exc}") from None
        image_token = getattr(self.processor, "image_token", None)
        if image_token is None or getattr(self.processor, "image_processor", None) is None:
            raise ConfigError(f"the model in {model_dir} has no image processor (its processor takes no images)")
        self.tokenizer = self.processor.tokenizer
        self.image_token: str = image_token
        self.chat_image_text: str = image_token
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(image_token)

    def _load_grid_processor(self, model_dir: str) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        try:
            self.image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"the model in {model_dir} has no image processor: {exc}") from None
        self.grid_merge_size = int(self.image_processor.merge_size)
        self.image_token_id = int(config.image_token_id)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        start, end = (self.tokenizer.convert_ids_to_tokens(int(getattr(config, f"vision_{which}_token_id")))
                      for which in ("start", "end"))
        self.chat_image_text = start + self.image_token + end

    def process(self, prompt: str, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """(token ids, one ImageInput per image) for a prompt holding one `image_token` per image."""
        marks = prompt.count(self.image_token)
        if marks != len(images):
            raise InvalidRequestError(f"the prompt marks {marks} image(s) with {self.image_token!r} but "
                                      f"{len(images)} image(s) were given", param="multi_modal_data")
        if not images:
            return self.tokenizer.encode(prompt), []
        try:
            if self.grid_merge_size:
                return self._process_grids(prompt, images)
            out = self.processor(text=[prompt], images=list(images), return_tensors="np")
        except InvalidRequestError:
            raise
        except Exception as exc:  # a picture the processor cannot take (mode, size): the request's fault
            raise InvalidRequestError(f"cannot process the image(s): {exc}", param="multi_modal_data") from None
        token_ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return token_ids, image_inputs(token_ids, self.image_token_id, list(pixels))

    def _process_grids(self, prompt: str, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        out = self.image_processor(images=list(images), return_tensors="np")
        grids = [[int(v) for v in grid] for grid in out["image_grid_thw"]]
        counts = [t * h * w // self.grid_merge_size ** 2 for t, h, w in grids]
        pieces = prompt.split(self.image_token)
        text = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        token_ids = self.tokenizer.encode(text)
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        bounds = np.cumsum([0] + [t * h * w for t, h, w in grids])
        per_image = [pixels[bounds[i]:bounds[i + 1]] for i in range(len(grids))]
        return token_ids, image_inputs(token_ids, self.image_token_id, per_image, grids, counts)


def _model_type(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def image_inputs(token_ids: list[int], image_token_id: int, pixels: list[np.ndarray],
                 grids: list[list[int]] | None = None, counts: list[int] | None = None) -> list[ImageInput]:
    """Each image's placeholder run in `token_ids`, in order: `counts[i]` tokens for image i
    (default: the same count per image). `grids`: each image's patch grid (t, h, w)."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if counts is None:
        if not pixels or len(positions) % len(pixels):
            raise InvalidRequestError(f"{len(positions)} image placeholder tokens for {len(pixels)} images",
                                      param="multi_modal_data")
        counts = [len(positions) // len(pixels)] * len(pixels)
    if len(positions) != sum(counts):
        raise InvalidRequestError(f"{len(positions)} image placeholder tokens for {len(pixels)} images of "
                                  f"{sum(counts)} tokens", param="multi_modal_data")
    inputs = []
    first = 0
    for index, (image, count) in enumerate(zip(pixels, counts)):
        offset = positions[first]
        if positions[first + count - 1] != offset + count - 1:
            raise InvalidRequestError(f"image {index}'s placeholder tokens are not consecutive", param="messages")
        first += count
        grid = list(grids[index]) if grids else []
        data = image.tobytes()
        digest = hashlib.sha256(repr((image.shape, grid)).encode() + data).hexdigest()
        inputs.append(ImageInput(offset=offset, length=count, content_hash=digest, grid_thw=grid,
                                 pixel_values=TensorData(data=data, dtype=str(image.dtype), shape=list(image.shape))))
    return inputs
