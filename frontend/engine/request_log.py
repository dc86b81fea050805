"""vLLM's --enable-log-requests: one INFO line when a request goes to the engine
(its id, prompt and sampling parameters, the prompt cut to --max-log-len
tokens) and one when it ends (why, and how many tokens it made). Off by
default: prompts are the clients' data."""
from __future__ import annotations

import logging

from frontend.engine.generation_request import GenerationRequest

logger = logging.getLogger("pagedserve.requests")


class RequestLogger:
    def __init__(self, tokenizer, max_log_len: int | None = None):
        self.tokenizer = tokenizer
        self.max_log_len = max_log_len  # prompt tokens shown; None: all of them

    def received(self, request: GenerationRequest) -> None:
        ids = request.prompt_token_ids
        shown = ids if self.max_log_len is None else ids[:self.max_log_len]
        cut = f" (first {len(shown)} of {len(ids)})" if len(shown) < len(ids) else ""
        logger.info("Received request %s: prompt: %r, prompt_token_ids%s: %s, params: %s",
                    request.request_id, self.tokenizer.decode(shown), cut, shown, request.sampling_params)

    def finished(self, request_id: str, reason: str, num_output_tokens: int) -> None:
        logger.info("Finished request %s: %s after %d output tokens", request_id, reason, num_output_tokens)
