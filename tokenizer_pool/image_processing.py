"""A prompt with images -> its token ids (each image's placeholders expanded) and the pixel
values, by the model's own processor from transformers (AutoProcessor from the model
directory; nothing is downloaded). The tokenizer pool and the offline LLM run this, so the
worker gets ready pixel tensors and only runs the vision encoder.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from common.errors import ConfigError, InvalidRequestError
from common.protocol import ImageInput, TensorData


class ImagePromptProcessor:
    """Wraps the model's processor (LlavaProcessor and alike); `image_token` is the text a
    prompt marks each image's place with."""

    def __init__(self, model_dir: str):
        from transformers import AutoProcessor

        try:
            self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"the model in {model_dir} has no image processor: {exc}") from None
        image_token = getattr(self.processor, "image_token", None)
        if image_token is None or getattr(self.processor, "image_processor", None) is None:
            raise ConfigError(f"the model in {model_dir} has no image processor (its processor takes no images)")
        self.image_token: str = image_token
        self.image_token_id: int = self.processor.tokenizer.convert_tokens_to_ids(image_token)

    def process(self, prompt: str, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """(token ids, one ImageInput per image) for a prompt holding one `image_token` per image."""
        marks = prompt.count(self.image_token)
        if marks != len(images):
            raise InvalidRequestError(f"the prompt marks {marks} image(s) with {self.image_token!r} but "
                                      f"{len(images)} image(s) were given", param="multi_modal_data")
        if not images:
            return self.processor.tokenizer.encode(prompt), []
        try:
            out = self.processor(text=[prompt], images=list(images), return_tensors="np")
        except Exception as exc:  # a picture the processor cannot take (mode, size): the request's fault
            raise InvalidRequestError(f"cannot process the image(s): {exc}", param="multi_modal_data") from None
        token_ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return token_ids, image_inputs(token_ids, self.image_token_id, list(pixels))


def image_inputs(token_ids: list[int], image_token_id: int, pixels: list[np.ndarray]) -> list[ImageInput]:
    """Each image's placeholder run in `token_ids` (the same count per image, in order)."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if not pixels or len(positions) % len(pixels):
        raise InvalidRequestError(f"{len(positions)} image placeholder tokens for {len(pixels)} images",
                                  param="multi_modal_data")
    per_image = len(positions) // len(pixels)
    inputs = []
    for index, image in enumerate(pixels):
        offset = positions[index * per_image]
        if positions[index * per_image + per_image - 1] != offset + per_image - 1:
            raise InvalidRequestError(f"image {index}'s placeholder tokens are not consecutive", param="messages")
        data = image.tobytes()
        digest = hashlib.sha256(repr(image.shape).encode() + data).hexdigest()
        inputs.append(ImageInput(offset=offset, length=per_image, content_hash=digest,
                                 pixel_values=TensorData(data=data, dtype=str(image.dtype), shape=list(image.shape))))
    return inputs
