"""vLLM's `/tokenize` and `/detokenize`: the server's own tokenizer and chat
template, without generating (clients count tokens, check a rendered chat,
or turn ids back into text with exactly what the server would use).

POST /tokenize   {"prompt": str, "add_special_tokens": true}
              or {"messages": [...], "add_generation_prompt": true, ...}
              -> {"count", "max_model_len", "tokens", "token_strs"}
POST /detokenize {"tokens": [int, ...]} -> {"prompt": str}

Both go through the tokenizer pool like generation requests do, and take
`model` (optional; a name not served is a 404) as the other routes do.
"""
from __future__ import annotations

from pydantic import Field

from common.errors import InvalidRequestError
from frontend.openai.request_bodies import ChatMessageParam, ChatTemplateRequest
from frontend.openai.response_bodies import OpenAIBaseModel
from frontend.openai.request_body_base import TextRequest
from frontend.openai.serving_chat import render_chat_prompt
from frontend.frontend_state import FrontendState


class TokenizeRequest(TextRequest, ChatTemplateRequest):
    """A prompt (as /v1/completions takes it) or chat messages (as /v1/chat/completions)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt; a chat template places its own
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


async def tokenize(state: FrontendState, body: TokenizeRequest) -> TokenizeResponse:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give either prompt or messages", param="prompt")
    if body.prompt is not None:
        tokens = await state.tokenizer_client.encode(body.prompt,
                                                     add_special_tokens=body.add_special_tokens is not False)
    else:
        body.check_template_options()
        tokens, _ = await render_chat_prompt(state, body)
    token_strs = state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=await state.max_model_len(), tokens=tokens,
                            token_strs=token_strs)


async def detokenize(state: FrontendState, body: DetokenizeRequest) -> DetokenizeResponse:
    return DetokenizeResponse(prompt=await detokenize_ids(state, body.model, body.tokens, param="tokens"))


async def detokenize_ids(state: FrontendState, model: str | None, token_ids: list[int], param: str) -> str:
    """The text the ids spell (for HTTP /detokenize and gRPC Detokenize)."""
    state.check_model(model)
    vocab_size = await state.generator.vocab_size()
    for index, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"{param}[{index}] = {token} is not a token id (the vocabulary has "
                                      f"{vocab_size})", param=param)
    # Special tokens stay in: the text is exactly what the ids spell.
    return await state.tokenizer_client.decode(token_ids, skip_special_tokens=False)
