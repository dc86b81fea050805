"""Image prompts of the offline LLM, vLLM's form:
`{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": pil_image}}`
(`image`: one PIL image or a list, one per image token of the prompt)."""
from __future__ import annotations

from typing import Any

from common.errors import InvalidRequestError
from common.protocol import ImageInput


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
    limit = llm.config.limit_mm_per_prompt.get("image", 1) if llm.config.limit_mm_per_prompt else 1
    if len(images) > limit:
        raise InvalidRequestError(f"{len(images)} images in one prompt; at most {limit} "
                                  "(limit_mm_per_prompt)", param="prompts")
    processor = getattr(llm, "_image_processor", None)
    if processor is None:
        if not hasattr(getattr(llm.worker, "model", None), "encode_images"):
            raise InvalidRequestError(f"the model {llm.config.model} takes no images (it has no vision encoder)",
                                      param="prompts")
        from tokenizer_pool.image_processing import ImagePromptProcessor

        processor = llm._image_processor = ImagePromptProcessor(llm.config.tokenizer or llm.worker.model_dir)
    token_ids, inputs = processor.process(prompt["prompt"], list(images))
    return (prompt["prompt"], token_ids), inputs
