"""LLaVA through the offline engine: greedy tokens equal transformers' generate on the same
image and text (a tiny random model built from configs, saved with its processor)."""
from __future__ import annotations

import pytest
import torch

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from tests.tiny_vision_models import build_tiny_llava, random_image

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from pagedserve.offline.llm import LLM

    directory = tmp_path_factory.mktemp("llava")
    model, processor = build_tiny_llava(directory)
    llm = LLM(model=str(directory), dtype="float32", device="cpu", attention_backend="torch", block_size=4,
              seed=0, enforce_eager=True, max_num_batched_tokens=12, limit_mm_per_prompt={"image": 2})
    return model, processor, llm


def hf_greedy_with_images(model, processor, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("images", [[0], [1, 2]], ids=["one-image", "two-images"])
def test_greedy_equals_transformers_generate(llava, images):
    model, processor, llm = llava
    pictures = [random_image(seed) for seed in images]
    prompt = PROMPT if len(pictures) == 1 else "USER: <image> and <image>: which differs? ASSISTANT:"
    expected = hf_greedy_with_images(model, processor, prompt, pictures, 8)
    # max_num_batched_tokens 12 cuts each image's 16 placeholders over two chunks.
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": pictures}},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_images_change_the_output_and_text_prompts_still_run(llava):
    model, processor, llm = llava
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": random_image(seed)}} for seed in (3, 4)]
                        + ["Hello there"], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    text_ids = processor.tokenizer.encode("Hello there")
    with torch.no_grad():
        ref = model.generate(torch.tensor([text_ids]), max_new_tokens=6, do_sample=False,
                             attention_mask=torch.ones(1, len(text_ids), dtype=torch.long))
    assert outs[2].outputs[0].token_ids == ref[0, len(text_ids):].tolist()


def test_bad_image_prompts_are_invalid_requests(llava):
    _, _, llm = llava
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="at most 2"):
        llm.generate({"prompt": "<image>" * 3, "multi_modal_data": {"image": [random_image(0)] * 3}}, params)
    with pytest.raises(InvalidRequestError, match="marks 1 image"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [random_image(0)] * 2}}, params)
    with pytest.raises(InvalidRequestError, match="only 'image'"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": random_image(0)}}, params)
    from common.beam_search import BeamSearchParams
    with pytest.raises(InvalidRequestError, match="generate and chat only"):
        llm.beam_search([{"prompt": PROMPT, "multi_modal_data": {"image": random_image(0)}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    assert llm.generate("still serving", params, use_tqdm=False)[0].outputs[0].token_ids


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def test_chat_with_a_data_url_image_equals_transformers(llava):
    import base64

    from tests.tiny_vision_models import png_bytes

    model, processor, llm = llava
    image = random_image(5)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    expected = hf_greedy_with_images(model, processor, "USER: What is this?\n<image>\nASSISTANT:", [image], 6)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                   chat_template=CHAT_TEMPLATE)
    assert out[0].outputs[0].token_ids == expected
    with pytest.raises(InvalidRequestError, match="base64"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url[:-3] + "%%%"}}]}],
                 chat_template=CHAT_TEMPLATE)
