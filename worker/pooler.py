"""Pooling: one vector per pooling request from the model's final hidden states.

A prompt may run in several chunks (chunked prefill): MEAN keeps the float32 sum of the
chunks so far, CLS the first token's state, LAST needs only the chunk that ends the prompt.
When the prompt's last chunk has run, the vector is finished as vLLM's embedding head does:
cast to float32, cut to `dimensions` (Matryoshka), then L2-normalised when asked.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.errors import ConfigError
from common.pooling_params import (PoolerInfo, PoolingParams, is_bare_decoder_config, is_encoder_config,
                                   matryoshka_info, model_pooler_defaults, pooling_only_config)


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """The pooled state as the request gets it: float32, truncated, normalised as asked."""
    vector = vector.to(torch.float32)
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector.tolist()


def pool_step(pooling: list, hidden: torch.Tensor) -> dict[str, list[float]]:
    """Fold this step's chunks into each pooling request's state (`pooling`: the StepBatch's
    (state, first row in `hidden`, rows) entries, before the step is committed); return the
    vectors of the requests whose prompt ended this step, by request id."""
    pooled: dict[str, list[float]] = {}
    for state, start, n in pooling:
        params: PoolingParams = state.pooling_params
        chunk = hidden[start:start + n]
        first_position = state.num_computed_tokens
        ends = first_position + n >= state.num_prompt_tokens
        kind = params.pooling_type
        if kind == "LAST":
            if ends:
                pooled[state.request_id] = finish_vector(chunk[-1], params)
            continue
        if kind not in ("MEAN", "CLS"):
            raise ValueError(f"request {state.request_id!r}: unknown pooling type {kind!r}")
        if first_position == 0:
            state.pooled_so_far = None  # a recomputed prompt starts over
        elif state.pooled_so_far is None:  # the scheduler gives MEAN/CLS requests no prefix hits
            raise ValueError(f"request {state.request_id!r}: {kind} pooling needs the hidden states of every "
                             f"prompt token, but its chunk starts at position {first_position}")
        if kind == "CLS":
            if first_position == 0:
                state.pooled_so_far = chunk[0].to(torch.float32)
        else:
            total = chunk.to(torch.float32).sum(dim=0)
            state.pooled_so_far = total if state.pooled_so_far is None else state.pooled_so_far + total
        if ends:
            vector = state.pooled_so_far
            if kind == "MEAN":
                vector = vector / state.num_prompt_tokens
            pooled[state.request_id] = finish_vector(vector, params)
            state.pooled_so_far = None
    return pooled


def pooler_info(config, model_dir: str, hf_config) -> PoolerInfo | None:
    """What this worker pools with (None: it generates). `--runner auto` pools for encoder-only
    models and decoders saved without their LM head; `--pooler-config` overrides the model files' pooling type and normalisation."""
    runner = config.runner
    if runner == "auto":
        runner = "pooling" if pooling_only_config(hf_config) else "generate"
    if runner == "generate" and is_bare_decoder_config(hf_config):
        raise ConfigError(f"{hf_config.architectures[0]} has no LM head (an embedding model's checkpoint): "
                          "it cannot generate; serve it with --runner pooling (or auto)")
    if runner != "pooling":
        return None
    if config.pipeline_parallel_size > 1:
        raise ConfigError("runner 'pooling' runs on one pipeline stage; pipeline_parallel_size must be 1")
    pooling_type, normalize = model_pooler_defaults(model_dir, hf_config)
    override = config.pooler_config
    if override is not None:
        pooling_type = override.pooling_type or pooling_type
        normalize = normalize if override.normalize is None else override.normalize
    is_matryoshka, dims = matryoshka_info(hf_config)
    return PoolerInfo(pooling_type=pooling_type, normalize=normalize, hidden_size=int(hf_config.hidden_size),
                      is_matryoshka=is_matryoshka, matryoshka_dimensions=dims,
                      bidirectional=is_encoder_config(hf_config))
