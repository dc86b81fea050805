"""Image content parts of chat messages -> PIL images, within limits.

`image_url` parts carry `data:image/png;base64,...` (or JPEG, ...) URLs, or http(s) URLs whose
host is in `allowed_domains` (--allowed-media-domains; none by default: refused), fetched by
tokenizer_pool.image_fetching. Every failure is the request's: InvalidRequestError (HTTP 400),
never a crash.
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from tokenizer_pool.image_fetching import DEFAULT_FETCH_TIMEOUT, fetch_image_bytes

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20  # decoded file size
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_images: int = 1  # per prompt (limit_mm_per_prompt's "image")
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) image URLs are fetched (lower case)
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT


def decode_image_url(url: Any, limits: ImageLimits = ImageLimits()):
    """The RGB PIL image a data URL (or an allowed http(s) URL) holds."""
    if not isinstance(url, str):
        raise InvalidRequestError("image_url.url must be a string", param="messages")
    if url.startswith(("http://", "https://")):
        return open_image(fetch_image_bytes(url, limits.allowed_domains, limits.max_bytes, limits.fetch_timeout),
                          limits)
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
    return open_image(data, limits)


def open_image(data: bytes, limits: ImageLimits):
    """The RGB PIL image in an image file's bytes, within the pixel limit."""
    from PIL import Image

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
