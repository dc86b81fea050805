"""`LLM.embed`: pooling requests on the offline engine, with vLLM's output shapes
(`EmbeddingRequestOutput.outputs.embedding`)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import InvalidRequestError
from common.pooling_params import PoolingParams
from common.protocol import EngineRequest
from common.sampling_params import SamplingParams


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One prompt's embedding, shaped like vLLM's EmbeddingRequestOutput."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


def run_embed(llm, encoded: list[tuple[str | None, list[int]]],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None) -> list[EmbeddingRequestOutput]:
    """Queue every prompt (raising InvalidRequestError before any work for a bad one), run the
    engine loop until all are pooled, and return their vectors in prompt order."""
    if llm.replicas is not None:
        raise InvalidRequestError("LLM.embed runs on one replica; data_parallel_size must be 1",
                                  param="data_parallel_size")
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params_list = [pooling_params or PoolingParams()] * len(encoded)
    else:
        params_list = list(pooling_params)
        if len(params_list) != len(encoded):
            raise InvalidRequestError(f"got {len(params_list)} pooling params for {len(encoded)} prompts",
                                      param="pooling_params")
    scheduler = llm.scheduler
    ids = [f"embd-{next(llm._ids)}" for _ in encoded]
    results: dict[str, EmbeddingRequestOutput] = {}
    try:
        for request_id, (_, token_ids), params in zip(ids, encoded, params_list):
            scheduler.add_request(EngineRequest(request_id=request_id, prompt_token_ids=token_ids,
                                                sampling_params=SamplingParams(max_tokens=1),
                                                pooling_params=params, arrival_time=time.time()))
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            if plan is None:
                continue
            for out in scheduler.update(plan, llm.group.execute(plan)):
                if out.embedding is not None:
                    results[out.request_id] = EmbeddingRequestOutput(
                        out.request_id, EmbeddingOutput(out.embedding), [], out.num_cached_tokens)
    except BaseException:
        scheduler.abort_requests([r for r in ids if r not in results])
        raise
    for request_id, (_, token_ids) in zip(ids, encoded):
        results[request_id].prompt_token_ids = token_ids
    return [results[r] for r in ids]
