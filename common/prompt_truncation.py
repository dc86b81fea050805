"""vLLM's truncate_prompt_tokens: keep only a prompt's last k tokens.

Applied where prompts are tokenized (the frontend, the offline LLM), before
the length checks, so everything downstream (the scheduler, usage counts,
echo, prompt logprobs) sees only the prompt that actually runs.
"""
from __future__ import annotations

from common.errors import InvalidRequestError


def truncate_prompt(token_ids: list[int], truncate: int | None, max_model_len: int | None) -> list[int]:
    """The last `truncate` tokens (-1: the last max_model_len; None: all of them).
    Asking for more than max_model_len is an error, as in vLLM."""
    if truncate is None:
        return token_ids
    keep = truncate
    if truncate == -1:
        if not max_model_len:
            return token_ids  # the limit is not known yet: the scheduler checks the length itself
        keep = max_model_len
    if max_model_len and keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
            f"Please, select a smaller truncation size.", param="truncate_prompt_tokens")
    return token_ids[-keep:] if keep < len(token_ids) else token_ids
