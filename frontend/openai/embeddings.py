"""POST /v1/embeddings in OpenAI's shape: `input` a string, a list of strings, a token
array or a list of token arrays; `encoding_format` float or base64 (little-endian float32,
as the openai client decodes it); `dimensions` (Matryoshka models only, else 400);
`usage.prompt_tokens`. vLLM's extras: `normalize`, `truncate_prompt_tokens`,
`add_special_tokens`, `priority`."""
from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import StrictInt, StrictStr

from common.errors import InvalidRequestError
from common.pooling_params import PoolingParams
from frontend.engine.embedding import embed_all, embedding_token_ids
from frontend.openai.http_replies import json_reply
from frontend.openai.request_body_base import TextRequest
from frontend.frontend_state import FrontendState, request_ids

EmbeddingInput = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class EmbeddingRequest(TextRequest):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None is the model's default
    truncate_prompt_tokens: StrictInt | None = None  # keep the last k tokens; -1: max_model_len
    add_special_tokens: bool = True
    priority: int = 0

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, each one embedding; 400 when there is none or one is empty."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise InvalidRequestError("input is empty: give a string, a list of strings, a token array or "
                                      "a list of token arrays", param="input")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise InvalidRequestError(f"input[{i}] is empty", param="input")
        return items

    def pooling_params(self) -> PoolingParams:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}", param="dimensions")
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embedding(state: FrontendState, body: EmbeddingRequest, raw_request: Request) -> Response:
    state.check_model(body.model)
    params = body.pooling_params()
    items = body.inputs()
    inputs = await asyncio.gather(*(embedding_token_ids(state, item, body.add_special_tokens,
                                                        body.truncate_prompt_tokens) for item in items))
    response_id, engine_id = request_ids(raw_request, "embd-")

    async def work() -> dict:
        results = await embed_all(state, engine_id, inputs, params, priority=body.priority)
        prompt_tokens = sum(r.num_prompt_tokens for r in results)
        return {"id": response_id, "object": "list", "created": int(time.time()), "model": state.model_name,
                "data": [{"object": "embedding", "index": i, "embedding": encode_vector(r.vector, body.encoding_format)}
                         for i, r in enumerate(results)],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

    return await json_reply(raw_request, work())
