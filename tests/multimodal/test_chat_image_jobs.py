"""A tokenizer worker's chat jobs with image parts (tokenizer_pool.jobs + chat_images): token ids
and pixels as the model's own processor makes them, the worker's limits, http(s) image URLs
fetched from a local server only for allowed hosts, and text-only models refused."""
from __future__ import annotations

import base64
import http.server
import threading

import msgspec
import numpy as np
import pytest

from common.protocol import ChatMessage, RenderChatJob, TokenizerReply
from common.tokenizer import load_tokenizer
from tests.tiny_vision_models import build_tiny_llava, png_bytes, random_image
from tokenizer_pool.chat_images import ChatImages
from tokenizer_pool.image_decoding import ImageLimits
from tokenizer_pool.jobs import run_job

# The tiny LLaVA's tokenizer has no template of its own (--chat-template gives it one).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    _, processor = build_tiny_llava(directory)
    return str(directory), processor


@pytest.fixture(scope="module")
def image_server():
    """127.0.0.1 serving /cat.png, /big.png (larger), /moved (a redirect to localhost)."""
    files = {"/cat.png": png_bytes(random_image(7)), "/big.png": png_bytes(random_image(8, size=(64, 64)))}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/cat.png")
                self.end_headers()
                return
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()  # no Content-Length: the byte cap must hold while streaming
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", files
    server.shutdown()


def chat_job(*urls: str, text: str = "What is this?") -> RenderChatJob:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return RenderChatJob(job_id="j", messages=[ChatMessage(role="user", content=parts)])


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def roundtrip(reply: TokenizerReply) -> TokenizerReply:
    """As it crosses the socket."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=TokenizerReply)


def test_images_render_as_the_models_processor_makes_them(llava_dir):
    model_dir, processor = llava_dir
    tokenizer = load_tokenizer(model_dir, CHAT_TEMPLATE)
    pictures = [random_image(1), random_image(2)]
    reply = roundtrip(run_job(tokenizer, chat_job(*(data_url(png_bytes(p)) for p in pictures)),
                              ChatImages(model_dir, ImageLimits(max_images=2))))
    assert reply.error is None, reply.error
    text = "USER: What is this?\n<image>\n<image>\nASSISTANT:"
    assert reply.text == text
    expected = processor(text=[text], images=pictures, return_tensors="np")
    assert reply.token_ids == expected["input_ids"][0].tolist()
    ids = reply.token_ids
    runs = [i for i, t in enumerate(ids) if t == processor.image_token_id and (i == 0 or ids[i - 1] != t)]
    assert [(image.offset, image.length) for image in reply.images] == [(start, 16) for start in runs]
    assert len(runs) == 2 and ids.count(processor.image_token_id) == 32
    for image, pixels in zip(reply.images, expected["pixel_values"]):
        got = np.frombuffer(image.pixel_values.data, dtype=image.pixel_values.dtype)
        assert np.array_equal(got.reshape(image.pixel_values.shape), pixels)
    assert reply.images[0].content_hash != reply.images[1].content_hash


@pytest.mark.parametrize("job, message", [
    (chat_job(*[data_url(png_bytes(random_image(0)))] * 2), "more than 1 image"),
    (chat_job("data:image/png;base64,%%%"), "base64"),
    (chat_job(data_url(b"plain text, not a picture")), "not an image"),
    (chat_job(data_url(png_bytes(random_image(0))), text="two marks <image>"), "marks 2 image"),
    (chat_job("http://127.0.0.1:9/cat.png"), "--allowed-media-domains"),
])
def test_bad_images_are_errors_and_the_worker_goes_on(llava_dir, job, message):
    model_dir, _ = llava_dir
    tokenizer, images = load_tokenizer(model_dir, CHAT_TEMPLATE), ChatImages(model_dir)
    reply = run_job(tokenizer, job, images)
    assert reply.error is not None and message in reply.error and not reply.images
    assert run_job(tokenizer, chat_job(data_url(png_bytes(random_image(3)))), images).error is None


def test_http_urls_are_fetched_from_allowed_hosts_only(llava_dir, image_server):
    model_dir, _ = llava_dir
    base, files = image_server
    tokenizer = load_tokenizer(model_dir, CHAT_TEMPLATE)
    cap = len(files["/cat.png"]) + 16
    allowed = ChatImages(model_dir, ImageLimits(allowed_domains=("127.0.0.1",), max_bytes=cap))
    fetched = run_job(tokenizer, chat_job(f"{base}/cat.png"), allowed)
    inline = run_job(tokenizer, chat_job(data_url(files["/cat.png"])), allowed)
    assert fetched.error is None and fetched.token_ids == inline.token_ids
    assert fetched.images[0].content_hash == inline.images[0].content_hash
    assert len(files["/big.png"]) > cap
    for path, message in (("/big.png", f"larger than {cap} bytes"), ("/none.png", "HTTP 404"),
                          ("/moved", "'localhost' is not in --allowed-media-domains")):
        reply = run_job(tokenizer, chat_job(base + path), allowed)
        assert reply.error is not None and message in reply.error, reply.error
    other_host = ChatImages(model_dir, ImageLimits(allowed_domains=("example.com",)))
    assert "'127.0.0.1' is not in" in run_job(tokenizer, chat_job(f"{base}/cat.png"), other_host).error


def test_a_text_only_model_takes_no_images(tmp_path):
    from tests.tiny_models import build_tiny_llama_with_smollm2_tokenizer

    build_tiny_llama_with_smollm2_tokenizer(tmp_path)
    tokenizer, images = load_tokenizer(str(tmp_path)), ChatImages(str(tmp_path))
    for _ in range(2):  # the failed load is remembered, the answer the same
        reply = run_job(tokenizer, chat_job(data_url(png_bytes(random_image(0)))), images)
        assert reply.error is not None and "takes no images" in reply.error
    text = RenderChatJob(job_id="t", messages=[ChatMessage(role="user", content="hello")])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                             add_generation_prompt=True)
    assert run_job(tokenizer, text, images).token_ids == tokenizer.encode(rendered, add_special_tokens=False)
