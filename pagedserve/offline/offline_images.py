"""Image prompts of the offline LLM, vLLM's forms: generate takes
`{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": pil_image}}`
(`image`: one PIL image or a list, one per image token of the prompt); chat takes messages
with `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` parts."""
from __future__ import annotations

from typing import Any

from common.errors import InvalidRequestError
from common.protocol import ImageInput
from common.tokenizer import render_chat_prompt


def image_limit(llm: Any) -> int:
    """Images allowed in one prompt (limit_mm_per_prompt; 1 by default, as vLLM's)."""
    return (llm.config.limit_mm_per_prompt or {}).get("image", 1)


def image_processor(llm: Any):
    """The model's ImagePromptProcessor, loaded once; InvalidRequestError for a text-only model."""
    processor = getattr(llm, "_image_processor", None)
    if processor is None:
        if not hasattr(getattr(llm.worker, "model", None), "encode_images"):
            raise InvalidRequestError(f"the model {llm.config.model} takes no images (it has no vision encoder)",
                                      param="prompts")
        from tokenizer_pool.image_processing import ImagePromptProcessor

        processor = llm._image_processor = ImagePromptProcessor(llm.config.tokenizer or llm.worker.model_dir)
    return processor


def prompt_images(llm: Any, prompt: Any) -> tuple[tuple[str, list[int]], list[ImageInput]] | None:
    """((text, token ids), images) for a prompt with `multi_modal_data`; None for any other."""
    if not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
        return None
    data = prompt["multi_modal_data"]
    unknown = sorted(set(data) - {"image"}) if isinstance(data, dict) else ["(not a dict)"]
    if unknown:
        raise InvalidRequestError(f"unsupported multi_modal_data {unknown}; only 'image' is", param="prompts")
    if not isinstance(prompt.get("prompt"), str):
        raise InvalidRequestError("a prompt with images needs its text as 'prompt'", param="prompts")
    images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
    if len(images) > image_limit(llm):
        raise InvalidRequestError(f"{len(images)} images in one prompt; at most {image_limit(llm)} "
                                  "(limit_mm_per_prompt)", param="prompts")
    token_ids, inputs = image_processor(llm).process(prompt["prompt"], list(images))
    return (prompt["prompt"], token_ids), inputs


def has_image_parts(conversation: list[dict]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in conversation)


def chat_image_prompt(llm: Any, conversation: list[dict], **render: Any) -> dict:
    """A chat with image parts as a generate prompt: each image part becomes the model's image
    token in the rendered text, its data URL decoded (within the limits) into the prompt's images."""
    from tokenizer_pool.image_decoding import ImageLimits, split_chat_images

    processor = image_processor(llm)
    messages, images = split_chat_images(conversation, processor.chat_image_text, ImageLimits(max_images=image_limit(llm)))
    return {"prompt": render_chat_prompt(llm.tokenizer, messages, **render), "multi_modal_data": {"image": images}}
