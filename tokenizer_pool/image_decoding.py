"""Image content parts of chat messages -> PIL images, within limits.

`image_url` parts carry `data:image/png;base64,...` (or JPEG, ...) URLs. http(s) URLs are
refused: fetching them is not implemented (vLLM's --allowed-media-domains has no counterpart
yet). Every failure is the request's: InvalidRequestError (HTTP 400), never a crash.
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20  # decoded file size
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_images: int = 1  # per prompt (limit_mm_per_prompt's "image")
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


def decode_image_url(url: Any, limits: ImageLimits = ImageLimits()):
    """The RGB PIL image a data URL holds."""
    from PIL import Image

    if not isinstance(url, str):
        raise InvalidRequestError("image_url.url must be a string", param="messages")
    if url.startswith(("http://", "https://")):
        raise InvalidRequestError("image URLs over http(s) are not enabled on this server; send the image "
                                  "as a data URL (data:image/png;base64,...)", param="messages")
    header, comma, payload = url.partition(",")
    if not (url.startswith("data:image/") and comma and header.endswith(";base64")):
        raise InvalidRequestError("image_url.url must be a data URL: data:image/<type>;base64,<data>",
                                  param="messages")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise InvalidRequestError(f"the image is larger than {limits.max_bytes} bytes", param="messages")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image's base64 data is broken", param="messages") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                raise InvalidRequestError(f"the image has {width}x{height} pixels, more than {limits.max_pixels}",
                                          param="messages")
            return image.convert("RGB")
    except InvalidRequestError:
        raise
    except Exception as exc:  # not an image PIL reads (a text file, a truncated PNG), or a decompression bomb
        raise InvalidRequestError(f"the data is not an image this server reads: {exc}", param="messages") from None


def split_chat_images(messages: list[dict], image_token: str, limits: ImageLimits = ImageLimits()
                      ) -> tuple[list[dict], list[Any]]:
    """(messages with each image part replaced by a text part holding `image_token`, the images
    in order). Parts: {"type": "image_url", "image_url": {"url": ...}} (or "url" a string)."""
    images: list[Any] = []
    out: list[dict] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                if len(images) >= limits.max_images:
                    raise InvalidRequestError(f"more than {limits.max_images} image(s) in one prompt "
                                              "(--limit-mm-per-prompt)", param="messages")
                ref = part.get("image_url")
                images.append(decode_image_url(ref.get("url") if isinstance(ref, dict) else ref, limits))
                parts.append({"type": "text", "text": image_token})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images
