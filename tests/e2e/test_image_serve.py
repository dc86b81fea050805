"""Issue 50, images over HTTP: `pagedserve serve` (the real process split) on a tiny random
vision-language model; the openai client sends a chat with a data-URL PNG and gets transformers'
greedy tokens for the same image and rendered prompt; an http image URL of an allowed host
(a local server) gives the same; too many images, broken base64, a non-image, an oversized
image and a host not allowed are 400s with OpenAI error bodies, and the server goes on.

VISION_MODELS lists the tiny model builders (name, build(directory) -> (model, processor),
the extra serve flags, the text an image part becomes in the rendered prompt): add one to run
every case on it."""
from __future__ import annotations

import base64
import http.server
import io
import threading

import openai
import pytest
import torch

from serve_helpers import running_server
from tiny_vision_models import build_tiny_llava, build_tiny_qwen2_vl, png_bytes, random_image

NEW_TOKENS = 8
# The tiny LLaVA's tokenizer has no template of its own.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
VISION_MODELS = [("llava", build_tiny_llava, ["--chat-template", CHAT_TEMPLATE], "<image>"),
                 ("qwen2_vl", build_tiny_qwen2_vl, ["--chat-template", CHAT_TEMPLATE],
                  "<|vision_start|><|image_pad|><|vision_end|>")]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def hf_greedy(model, processor, prompt: str, images: list) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy new tokens) of transformers' generate."""
    inputs = processor(text=[prompt], images=images, return_tensors="pt")  # Qwen2-VL: + image_grid_thw
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def oversized_png() -> bytes:
    """4100 x 4100 pixels, above the default 4096 x 4096 cap (one colour: a small file)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (4100, 4100)).save(buffer, format="PNG")
    return buffer.getvalue()


class ImageHost:
    """127.0.0.1 serving one PNG at /cat.png."""

    def __init__(self, body: bytes):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/cat.png" else 404)
                self.end_headers()
                self.wfile.write(body if self.path == "/cat.png" else b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("name, build, flags, image_text", VISION_MODELS, ids=[m[0] for m in VISION_MODELS])
def test_chat_images_over_http(tmp_path, name, build, flags, image_text):
    model_dir = tmp_path / name
    model, processor = build(model_dir)
    picture = random_image(11)
    host = ImageHost(png_bytes(picture))
    (tmp_path / "srv").mkdir()
    with running_server(tmp_path / "srv", ["--model", str(model_dir), "--enforce-eager", "--disable-log-stats",
                                           "--kv-cache-memory", "128MiB", "--tokenizer-pool-size", "1",
                                           "--limit-mm-per-prompt", '{"image": 2}',
                                           "--allowed-media-domains", "127.0.0.1", *flags]) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def chat(*parts: dict):
            return client.chat.completions.create(
                model=str(model_dir), temperature=0, max_tokens=NEW_TOKENS,
                messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}],
                extra_body={"ignore_eos": True, "return_token_ids": True})

        inline = chat(image_part(data_url(png_bytes(picture))))
        fetched = chat(image_part(f"http://127.0.0.1:{host.port}/cat.png"))

        def refused(*parts: dict) -> str:
            with pytest.raises(openai.BadRequestError) as caught:
                chat(*parts)
            error = caught.value.body
            assert caught.value.status_code == 400 and error["type"] == "invalid_request_error", error
            assert error["param"] == "messages", error
            return error["message"]

        good = image_part(data_url(png_bytes(random_image(12))))
        assert "3 images in one prompt; at most 2" in refused(good, good, good)
        assert "base64" in refused(image_part("data:image/png;base64,iVBORw0KGgo%%%"))
        assert "not an image" in refused(image_part(data_url(b"a text file, not a picture")))
        assert "4100x4100 pixels" in refused(image_part(data_url(oversized_png())))
        assert "not in --allowed-media-domains" in refused(image_part(f"http://localhost:{host.port}/cat.png"))
        again = chat(image_part(data_url(png_bytes(picture))))
    host.server.shutdown()

    prompt_ids, expected = hf_greedy(model, processor, f"USER: What is this?\n{image_text}\nASSISTANT:", [picture])
    for reply in (inline, fetched, again):
        assert reply.prompt_token_ids == prompt_ids
        assert reply.usage.prompt_tokens == len(prompt_ids)  # the image's placeholders count
        assert reply.choices[0].token_ids == expected
    assert prompt_ids.count(processor.image_token_id) > 1  # the placeholders expanded
