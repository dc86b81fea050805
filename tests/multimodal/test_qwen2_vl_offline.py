"""Qwen2-VL and Qwen2.5-VL through the offline engine: greedy tokens equal transformers' generate
on the same images and text (tiny random models built from configs, saved with their processor).
The engine prefills in chunks of 16 tokens, so every image prompt is cut across its images."""
from __future__ import annotations

import base64

import pytest
import torch

from common.sampling_params import SamplingParams
from tests.tiny_vision_models import build_tiny_qwen2_vl, png_bytes, random_image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE_IMAGE = f"USER: {IMAGE}What is in this picture? ASSISTANT:"
TWO_IMAGES = f"USER: {IMAGE} and {IMAGE}: which differs? ASSISTANT:"
CHUNK = 16  # max_num_batched_tokens: smaller than every image prompt (and than the larger images)
KV_CACHE_MEMORY = 2 ** 26  # bytes: plenty for these prompts (the default 4 GiB per engine adds up)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(tmp_path_factory, qwen25: bool):
    from pagedserve.offline.llm import LLM

    directory = tmp_path_factory.mktemp("qwen25vl" if qwen25 else "qwen2vl")
    model, processor = build_tiny_qwen2_vl(directory, qwen25=qwen25)
    llm = LLM(model=str(directory), dtype="float32", device="cpu", attention_backend="torch", block_size=4,
              seed=0, enforce_eager=True, max_num_batched_tokens=CHUNK, limit_mm_per_prompt={"image": 2},
              kv_cache_memory=KV_CACHE_MEMORY)
    return model, processor, llm


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return _engine(tmp_path_factory, qwen25=False)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return _engine(tmp_path_factory, qwen25=True)


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def engine(request):
    return request.getfixturevalue(request.param)


def hf_greedy(model, processor, prompt: str, images: list, max_new_tokens: int = 8) -> list[int]:
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def image_prompt(prompt: str, images: list) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def test_two_images_of_different_sizes_equal_transformers(engine):
    model, processor, llm = engine
    pictures = [random_image(1, (40, 36)), random_image(2, (64, 30))]  # 20 and 32 image tokens
    expected = hf_greedy(model, processor, TWO_IMAGES, pictures)
    out = llm.generate(image_prompt(TWO_IMAGES, pictures), GREEDY, use_tqdm=False)
    assert len(out[0].prompt_token_ids) > CHUNK
    assert out[0].outputs[0].token_ids == expected


def test_a_batch_mixing_image_and_text_prompts_equals_transformers(engine):
    model, processor, llm = engine
    pictures = [random_image(3), random_image(4, (24, 56))]
    prompts = [image_prompt(ONE_IMAGE, [pictures[0]]), "Hello there, how are", image_prompt(ONE_IMAGE, [pictures[1]])]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = [hf_greedy(model, processor, ONE_IMAGE, [pictures[0]]), hf_greedy(model, processor, prompts[1], []),
                hf_greedy(model, processor, ONE_IMAGE, [pictures[1]])]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected[0] != expected[2]  # the images matter


def test_prefix_cache_shares_blocks_of_the_same_image_only(qwen2_vl):
    model, processor, llm = qwen2_vl
    first, other = random_image(5), random_image(6)
    expected = hf_greedy(model, processor, ONE_IMAGE, [first])
    cold = llm.generate(image_prompt(ONE_IMAGE, [first]), GREEDY, use_tqdm=False)[0]
    warm = llm.generate(image_prompt(ONE_IMAGE, [first]), GREEDY, use_tqdm=False)[0]
    image_end = 4 + 20  # "USER: <|vision_start|>" then 20 placeholders
    assert warm.num_cached_tokens >= image_end > cold.num_cached_tokens
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids == expected
    changed = llm.generate(image_prompt(ONE_IMAGE, [other]), GREEDY, use_tqdm=False)[0]
    assert changed.num_cached_tokens <= 4  # only the block before the image
    assert changed.outputs[0].token_ids == hf_greedy(model, processor, ONE_IMAGE, [other])


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def test_chat_with_a_data_url_image_equals_transformers(qwen2_vl):
    model, processor, llm = qwen2_vl
    image = random_image(7, (48, 40))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    expected = hf_greedy(model, processor, f"USER: What is this?\n{IMAGE}\nASSISTANT:", [image])
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert out[0].outputs[0].token_ids == expected


def test_a_draft_model_beside_m_rope_is_refused(qwen2_vl):
    from common.errors import ConfigError
    from pagedserve.offline.llm import LLM

    directory = qwen2_vl[2].config.model
    with pytest.raises(ConfigError, match="M-RoPE"):
        LLM(model=directory, dtype="float32", device="cpu", attention_backend="torch", enforce_eager=True,
            kv_cache_memory=KV_CACHE_MEMORY,
            speculative_config={"method": "draft_model", "model": directory, "num_speculative_tokens": 2})
