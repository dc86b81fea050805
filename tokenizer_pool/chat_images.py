"""Chat jobs with image parts, in a tokenizer worker: each image part's URL decoded (or fetched)
within the limits, the chat template rendered with the model's image token in its place, and
the model's processor (ImagePromptProcessor) expanding the placeholders and making the pixel
values. The processor loads at the first job with images, so text-only models never load it;
for a model without one such a job is a 400.
"""
from __future__ import annotations

from typing import Any

from common.errors import ConfigError, InvalidRequestError
from common.protocol import RenderChatJob, TokenizerReply
from common.tokenizer import render_chat_prompt
from tokenizer_pool.image_decoding import ImageLimits, split_chat_images


def has_image_parts(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in messages)


class ChatImages:
    """A worker's image settings and its model's processor (loaded once, on first use)."""

    def __init__(self, model_dir: str, limits: ImageLimits = ImageLimits()):
        self.model_dir, self.limits = model_dir, limits
        self._processor: Any = None
        self._missing: str | None = None  # why the model takes no images (the load failed)

    def processor(self):
        if self._processor is None and self._missing is None:
            from tokenizer_pool.image_processing import ImagePromptProcessor

            try:
                self._processor = ImagePromptProcessor(self.model_dir)
            except ConfigError as exc:
                self._missing = str(exc)
        if self._processor is None:
            raise InvalidRequestError(f"the model {self.model_dir} takes no images ({self._missing})",
                                      param="messages")
        return self._processor

    def render(self, tokenizer, job: RenderChatJob, messages: list[dict]) -> TokenizerReply:
        """The reply to a chat job whose `messages` hold image parts. The processor tokenizes the
        rendered text as the offline LLM does (with the tokenizer's own special tokens):
        job.add_special_tokens does not apply here."""
        processor = self.processor()
        messages, images = split_chat_images(messages, processor.chat_image_text, self.limits)
        text = render_chat_prompt(tokenizer, messages, add_generation_prompt=job.add_generation_prompt,
                                  continue_final_message=job.continue_final_message,
                                  chat_template_kwargs=job.chat_template_kwargs or None)
        token_ids, inputs = processor.process(text, images)
        return TokenizerReply(job_id=job.job_id, token_ids=list(token_ids), text=text, images=inputs)
