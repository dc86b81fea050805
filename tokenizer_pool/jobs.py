"""What a tokenizer worker does with one job: a function of (tokenizer, job), and for chat
jobs with images of the worker's ChatImages (its limits and its model's processor).

Every failure becomes `TokenizerReply(error=...)`: a bad request must cost the
client an error message, never the worker its life.
"""
from __future__ import annotations

import logging

from common.errors import InvalidRequestError
from common.protocol import ChatMessage, DetokenizeJob, RenderChatJob, TokenizeJob, TokenizerReply
from common.tokenizer import render_chat_prompt
from tokenizer_pool.chat_images import ChatImages, has_image_parts

logger = logging.getLogger(__name__)

Job = TokenizeJob | RenderChatJob | DetokenizeJob


def run_job(tokenizer, job: Job, images: ChatImages | None = None) -> TokenizerReply:
    try:
        if isinstance(job, TokenizeJob):
            ids = tokenizer.encode(job.text, add_special_tokens=job.add_special_tokens)
            return TokenizerReply(job_id=job.job_id, token_ids=list(ids))
        if isinstance(job, RenderChatJob):
            return render_chat(tokenizer, job, images)
        if isinstance(job, DetokenizeJob):
            return TokenizerReply(job_id=job.job_id, text=detokenize(tokenizer, job))
        raise InvalidRequestError(f"not a tokenizer job: {type(job).__name__}")
    except InvalidRequestError as e:
        return TokenizerReply(job_id=job.job_id, error=e.message)
    except Exception as e:  # template errors, tokenizer errors: the request's fault, reported to it
        logger.warning("tokenizer job %s failed: %s: %s", job.job_id, type(e).__name__, e)
        return TokenizerReply(job_id=job.job_id, error=f"{type(e).__name__}: {e}")


def render_chat(tokenizer, job: RenderChatJob, images: ChatImages | None = None) -> TokenizerReply:
    messages = [message_to_dict(m) for m in job.messages]
    if has_image_parts(messages):
        if images is None:
            raise InvalidRequestError("this tokenizer pool takes no images", param="messages")
        return images.render(tokenizer, job, messages)
    text = render_chat_prompt(
        tokenizer, messages,
        add_generation_prompt=job.add_generation_prompt,
        continue_final_message=job.continue_final_message,
        chat_template_kwargs=job.chat_template_kwargs or None)
    # As common.tokenizer.apply_chat_template does (the template writes any BOS
    # itself, unless asked); rendered once here because the reply carries the text as well.
    ids = tokenizer.encode(text, add_special_tokens=job.add_special_tokens)
    return TokenizerReply(job_id=job.job_id, token_ids=list(ids), text=text)


def detokenize(tokenizer, job: DetokenizeJob) -> str:
    vocab_size = len(tokenizer)
    for token_id in job.token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"token id {token_id} is outside the vocabulary (size {vocab_size})")
    return tokenizer.decode(job.token_ids, skip_special_tokens=job.skip_special_tokens)


def message_to_dict(message: ChatMessage) -> dict:
    """The dict a chat template expects: role and content always, optional
    fields only when set (templates test `'tool_calls' in message`)."""
    out: dict = {"role": message.role, "content": message.content}
    for name in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, name)
        if value is not None:
            out[name] = value
    return out
