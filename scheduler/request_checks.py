"""What a new request must satisfy before the scheduler queues it: checked up front, so a
bad request gets a clear 400 and never reaches (or fails) a worker step. Never truncates."""
from __future__ import annotations

import logging

import msgspec

from common.config import window_fits
from common.errors import InvalidRequestError
from common.pooling_params import PoolerInfo
from common.protocol import EngineRequest

logger = logging.getLogger(__name__)


def servable_max_model_len(max_model_len: int, num_blocks: int, block_size: int, sliding_window: int = 0,
                           max_step_tokens: int = 0) -> int:
    """The longest sequence the KV cache holds alone: a lone request must always fit, or it
    would be preempted forever. A sequence of max_model_len tokens ends when its last token is
    sampled, so that token's KV is never needed. With a sliding window on every layer a request
    holds only the window plus one step's tokens (`max_step_tokens`, lookahead included)."""
    usable_tokens = (num_blocks - 1) * block_size  # block 0 is reserved
    if max_model_len - 1 > usable_tokens and not window_fits(sliding_window, num_blocks, block_size,
                                                              max_step_tokens):
        logger.warning("max_model_len=%d needs more KV cache than the %d tokens available (%d usable blocks "
                       "of %d); serving at most %d tokens per sequence", max_model_len, usable_tokens,
                       num_blocks - 1, block_size, usable_tokens + 1)
        return usable_tokens + 1
    return max_model_len


def check_new_request(engine_request: EngineRequest, vocab_size: int | None, max_model_len: int,
                      max_logprobs: int) -> None:
    """Raise InvalidRequestError naming the parameter at fault."""
    engine_request.sampling_params.validate(vocab_size, max_logprobs)
    num_prompt = len(engine_request.prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("The prompt is empty; at least one token is required", param="prompt")
    if vocab_size is not None:
        # An id the embedding lookup cannot take would fail the whole step on the worker.
        bad = next((t for t in engine_request.prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"Token id {bad} is out of vocabulary (size {vocab_size})", param="prompt")
    check_image_spans(engine_request)
    if engine_request.pooling_params is not None:
        if num_prompt > max_model_len:  # pooled, not continued: the prompt may fill max_model_len
            raise InvalidRequestError(
                f"The input has {num_prompt} tokens, but the maximum context length (max_model_len) is "
                f"{max_model_len} tokens; shorten the input", param="input", code="context_length_exceeded")
        return
    if num_prompt + 1 > max_model_len:
        raise InvalidRequestError(
            f"The prompt has {num_prompt} tokens, but the maximum context length (max_model_len) is "
            f"{max_model_len} tokens, which leaves no room for an output token; shorten the prompt",
            param="prompt", code="context_length_exceeded")
    params = engine_request.sampling_params
    if params.max_tokens is None and params.min_tokens > max_model_len - num_prompt:
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) is more than the {max_model_len - num_prompt} tokens "
            f"that fit after the prompt in max_model_len ({max_model_len})", param="min_tokens",
            code="context_length_exceeded")


def check_image_spans(engine_request: EngineRequest) -> None:
    """Each image's placeholders lie in the prompt, in order, without overlapping."""
    end = 0
    for i, image in enumerate(engine_request.images):
        if image.offset < end or image.length <= 0 or image.offset + image.length > len(engine_request.prompt_token_ids):
            raise InvalidRequestError(f"image {i}: placeholder tokens [{image.offset}, {image.offset + image.length}) "
                                      "are not inside the prompt after the previous image's", param="messages")
        end = image.offset + image.length
    if engine_request.images and engine_request.pooling_params is not None:
        raise InvalidRequestError("images are not supported in pooling requests", param="input")


def resolve_pooling(engine_request: EngineRequest, pooler: PoolerInfo | None,
                    max_num_batched_tokens: int) -> EngineRequest:
    """The request with its pooling parameters resolved against the worker's pooler. A pooling
    model serves only pooling requests and a generating one only generation (400 otherwise);
    an encoder runs whole prompts, so a prompt must fit in one step's token budget."""
    params = engine_request.pooling_params
    if pooler is None:
        if params is not None:
            raise InvalidRequestError("This model generates text; it does not serve embeddings (start the "
                                      "server with --runner pooling for an embedding model)", param="model")
        return engine_request
    if params is None:
        raise InvalidRequestError("This model serves embeddings (--runner pooling); it does not generate "
                                  "text: use /v1/embeddings", param="model")
    if engine_request.sampling_params.num_samples != 1:
        raise InvalidRequestError("An embedding request has one result; n and best_of must be 1", param="n")
    num_prompt = len(engine_request.prompt_token_ids)
    if pooler.bidirectional and num_prompt > max_num_batched_tokens:
        raise InvalidRequestError(
            f"The input has {num_prompt} tokens; an encoder model runs whole inputs, at most "
            f"max_num_batched_tokens ({max_num_batched_tokens}) in one step", param="input",
            code="context_length_exceeded")
    return msgspec.structs.replace(engine_request, pooling_params=pooler.resolve(params))
