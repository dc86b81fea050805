"""Image embeddings merged into a step's input embeddings at the placeholder positions.

A request's images are encoded (vision tower + projector) the first time a step computes
any of their placeholder tokens and kept with the request until the last of those tokens is
computed: a prefill chunk may cut an image's placeholders, so each chunk takes its slice.
Text-only steps never come here (their embedding is the model's own lookup).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.protocol import ImageInput, TensorData


@dataclass(slots=True)
class ImageChunk:
    """Rows [row, row + end - start) of a step take rows [start, end) of image `image` of `state`."""
    state: Any  # worker.input_batch.RequestState
    image: int
    row: int
    start: int
    end: int


def tensor_from_data(data: TensorData) -> torch.Tensor:
    """The tensor a TensorData carries (a copy: the message's bytes are read-only)."""
    array = np.frombuffer(data.data, dtype=np.dtype(data.dtype))
    expected = int(np.prod(data.shape)) if data.shape else 1
    if array.size != expected:
        raise ValueError(f"tensor data holds {array.size} values, its shape {data.shape} needs {expected}")
    return torch.from_numpy(array.reshape(data.shape).copy())


def plan_image_chunks(state: Any, row: int, first: int, count: int) -> list[ImageChunk]:
    """The image slices of `state`'s tokens [first, first + count), computed at step rows from `row`."""
    chunks = []
    for index, image in enumerate(state.images):
        start, end = max(first, image.offset), min(first + count, image.offset + image.length)
        if start < end:
            chunks.append(ImageChunk(state, index, row + start - first, start - image.offset, end - image.offset))
    return chunks


def encode_images(model: Any, images: list[ImageInput]) -> list[torch.Tensor]:
    """[placeholder tokens, hidden] for each image: Qwen2-VL's (images with a patch grid) in one
    encoder call, others one by one."""
    encode = getattr(model, "encode_images", None)
    if encode is None:
        raise ValueError(f"{type(model).__name__} has no vision encoder: it cannot take images")
    pixels = [tensor_from_data(image.pixel_values) for image in images]
    if all(image.grid_thw for image in images):
        merged = encode(torch.cat(pixels), grid_thw=[list(image.grid_thw) for image in images])
        if merged.shape[0] != sum(image.length for image in images):
            raise ValueError(f"the images encode to {merged.shape[0]} embeddings for "
                             f"{sum(image.length for image in images)} placeholder tokens")
        return list(merged.split([image.length for image in images]))
    out = []
    for image, values in zip(images, pixels):
        embeds = encode(values.unsqueeze(0) if values.dim() == 3 else values)
        embeds = embeds.reshape(-1, embeds.shape[-1])
        if embeds.shape[0] != image.length:
            raise ValueError(f"the image encodes to {embeds.shape[0]} embeddings for {image.length} placeholder tokens")
        out.append(embeds)
    return out


def merged_input_embeddings(model: Any, input_ids: torch.Tensor, chunks: list[ImageChunk]) -> torch.Tensor:
    """The step's input embeddings: the token embeddings, with each chunk's image rows in place."""
    embeds = model.embed(input_ids)
    missing = {(id(c.state), c.image): c for c in chunks if c.image not in c.state.image_embeds}
    if missing:  # the step's images not encoded yet, together
        encoded = encode_images(model, [c.state.images[c.image] for c in missing.values()])
        for chunk, rows in zip(missing.values(), encoded):
            chunk.state.image_embeds[chunk.image] = rows
    for chunk in chunks:
        cached = chunk.state.image_embeds
        image = chunk.state.images[chunk.image]
        rows = cached[chunk.image][chunk.start:chunk.end]
        embeds[chunk.row:chunk.row + rows.shape[0]] = rows.to(embeds.dtype)
        if chunk.end == image.length:  # its last placeholders: not needed again (unless recomputed)
            del cached[chunk.image]
    return embeds
