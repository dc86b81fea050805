"""Data-URL images of chat messages: decoded within limits; every bad input an
InvalidRequestError (HTTP 400)."""
import base64
import io

import pytest

from common.errors import InvalidRequestError
from tests.tiny_vision_models import png_bytes, random_image
from tokenizer_pool.image_decoding import ImageLimits, decode_image_url, split_chat_images


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def jpeg_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return buffer.getvalue()


def test_png_and_jpeg_data_urls_decode_to_rgb_images():
    image = random_image(0)
    decoded = decode_image_url(data_url(png_bytes(image)))
    assert decoded.mode == "RGB" and decoded.size == image.size and decoded.tobytes() == image.tobytes()
    assert decode_image_url(data_url(jpeg_bytes(image), "jpeg")).size == image.size


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,iVBORw0KGgo%%%", "base64 data is broken"),
    (data_url(b"just some text, no picture"), "not an image"),
    (data_url(png_bytes(random_image(0))[:40]), "not an image"),  # a truncated PNG
    ("https://example.com/cat.png", "not enabled"),
    ("file:///etc/passwd", "must be a data URL"),
    (42, "must be a string"),
])
def test_bad_image_urls_are_invalid_requests(url, message):
    with pytest.raises(InvalidRequestError, match=message):
        decode_image_url(url)


def test_oversized_images_are_refused_by_bytes_and_by_pixels():
    png = png_bytes(random_image(0, size=(64, 64)))
    with pytest.raises(InvalidRequestError, match="larger than 100 bytes"):
        decode_image_url(data_url(png), ImageLimits(max_bytes=100))
    with pytest.raises(InvalidRequestError, match="64x64 pixels"):
        decode_image_url(data_url(png), ImageLimits(max_pixels=63 * 64))


def test_chat_image_parts_become_image_tokens_up_to_the_limit():
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(random_image(1)))}}
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]
    out, images = split_chat_images(messages, "<image>")
    assert out[1]["content"] == [{"type": "text", "text": "what is it?"}, {"type": "text", "text": "<image>"}]
    assert out[0] == messages[0] and len(images) == 1
    with pytest.raises(InvalidRequestError, match="more than 1 image"):
        split_chat_images([{"role": "user", "content": [part, part]}], "<image>")
    assert len(split_chat_images([{"role": "user", "content": [part, part]}], "<image>",
                                 ImageLimits(max_images=2))[1]) == 2
