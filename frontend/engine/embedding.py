"""Embedding requests on the engine, shared by /v1/embeddings and gRPC Embed: check an
input's token ids, send it as a pooling request and wait for its vector, counting it in
the metrics. The scheduler decides the rest (a generating model refuses it with a 400)."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass

from common.errors import InvalidRequestError, PagedServeError
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from frontend.engine.frontend_metrics import RequestTimer

# A pooling request samples nothing; its sampling parameters only satisfy the wire format.
_NO_SAMPLING = SamplingParams(max_tokens=1)


@dataclass(slots=True)
class Embedding:
    vector: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int


async def embedding_token_ids(state, item: str | list[int], add_special_tokens: bool = True,
                              truncate_prompt_tokens: int | None = None) -> list[int]:
    """A text (tokenized by the pool) or token-id input's ids; with `truncate_prompt_tokens`,
    only its last k (-1: max_model_len), as vLLM's."""
    ids = (await state.tokenizer_client.encode(item, add_special_tokens=add_special_tokens)
           if isinstance(item, str) else list(item))
    keep = truncate_prompt_tokens
    if keep is not None:
        if keep == -1:
            keep = await state.max_model_len() or len(ids)
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                                      param="truncate_prompt_tokens")
        ids = ids[-keep:]
    return ids


async def check_embedding_input(state, token_ids: list[int], param: str = "input") -> None:
    """400 for an input the scheduler would refuse: empty, out of the vocabulary, too long."""
    if not token_ids:
        raise InvalidRequestError("An input is empty: at least one token is required", param=param)
    vocab_size = await state.generator.vocab_size()
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"Token id {bad} is out of vocabulary (size {vocab_size})", param=param)
    max_len = await state.max_model_len()
    if max_len is not None and len(token_ids) > max_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_len} tokens. However, an input has "
            f"{len(token_ids)} tokens. Please reduce the length of the input.", param=param,
            code="context_length_exceeded")


async def embed_one(state, request_id: str, token_ids: list[int], params: PoolingParams, *,
                    priority: int = 0, arrival: float | None = None) -> Embedding:
    """Run one input as a pooling request and return its vector (errors as PagedServeError)."""
    timer = RequestTimer(state.metrics, time.monotonic() if arrival is None else arrival)
    success = False
    try:
        outputs = state.engine.generate(request_id, token_ids, _NO_SAMPLING, priority=priority,
                                        pooling_params=params)
        async with aclosing(outputs):
            async for output in outputs:
                if output.error is not None:
                    raise InvalidRequestError(output.error)
                if output.embedding is not None:
                    success = True
                    timer.finished("stop", time.monotonic())
                    return Embedding(output.embedding, len(token_ids), output.num_cached_tokens)
                if output.request_finished:
                    break
        raise PagedServeError(f"request {request_id} finished without an embedding")
    except (asyncio.CancelledError, GeneratorExit):
        timer.finished("abort", time.monotonic())
        raise
    finally:
        state.metrics.record_embedding(success, len(token_ids) if success else 0)


async def embed_all(state, request_id: str, inputs: list[list[int]], params: PoolingParams, *,
                    priority: int = 0) -> list[Embedding]:
    """Every input at once (one scheduler request each, `<request_id>-<i>`), in input order."""
    arrival = time.monotonic()
    try:
        for ids in inputs:
            await check_embedding_input(state, ids)
    except PagedServeError:
        state.metrics.record_embedding(False)
        raise
    await state.engine.ensure_connected()
    tasks = [asyncio.ensure_future(embed_one(state, f"{request_id}-{i}", ids, params, priority=priority,
                                             arrival=arrival)) for i, ids in enumerate(inputs)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one failed (or the client left): the others are not needed any more
        for task in tasks:
            task.cancel()
