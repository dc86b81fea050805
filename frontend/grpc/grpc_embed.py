"""The gRPC Embed RPC: each input's pooled vector, through the same engine path as
/v1/embeddings (frontend.engine.embedding)."""
from __future__ import annotations

import asyncio

from common.errors import InvalidRequestError
from common.grpc_gen import pagedserve_pb2 as pb
from common.pooling_params import PoolingParams
from frontend.engine.embedding import embed_all, embedding_token_ids
from frontend.frontend_state import FrontendState, random_id


async def embed_response(state: FrontendState, request: pb.EmbedRequest) -> pb.EmbedResponse:
    """The RPC's answer; InvalidRequestError (INVALID_ARGUMENT) for bad input."""
    state.check_model(request.model or None)
    if request.texts and request.token_ids:
        raise InvalidRequestError("set texts or token_ids, not both", param="input")
    items: list[str | list[int]] = list(request.texts) or [list(t.ids) for t in request.token_ids]
    if not items:
        raise InvalidRequestError("no input: set texts or token_ids", param="input")
    if any(len(item) == 0 for item in items):
        raise InvalidRequestError("an input is empty", param="input")
    params = PoolingParams(dimensions=request.dimensions if request.HasField("dimensions") else None,
                           normalize=request.normalize if request.HasField("normalize") else None)
    if params.dimensions is not None and params.dimensions < 1:
        raise InvalidRequestError("dimensions must be at least 1", param="dimensions")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    truncate = request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
    inputs = await asyncio.gather(*(embedding_token_ids(state, item, add_special, truncate) for item in items))
    request_id = request.request_id or random_id("embd-")
    results = await embed_all(state, request_id, inputs, params, priority=request.priority)
    prompt_tokens = sum(r.num_prompt_tokens for r in results)
    return pb.EmbedResponse(
        request_id=request_id,
        embeddings=[pb.Embedding(index=i, values=r.vector, prompt_tokens=r.num_prompt_tokens)
                    for i, r in enumerate(results)],
        usage=pb.Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens,
                       cached_tokens=sum(r.num_cached_tokens for r in results)))
