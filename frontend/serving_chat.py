"""POST /v1/chat/completions: messages rendered by the tokenizer pool, one choice."""
from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.errors import InvalidRequestError
from frontend import sse
from frontend.async_utils import cancel_on_disconnect
from frontend.generation import GenerationDelta, GenerationRequest
from frontend.openai_protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatMessage, ChatStreamChoice, DeltaMessage, UsageInfo)
from frontend.state import SYSTEM_FINGERPRINT, FrontendState, request_base_id

ROLE = "assistant"


@dataclass(slots=True)
class _Reply:
    id: str
    created: int
    model: str

    def chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse.event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                             system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=usage))


def _usage(delta: GenerationDelta | None) -> UsageInfo:
    if delta is None:
        return UsageInfo.of(0, 0, 0)
    return UsageInfo.of(delta.num_prompt_tokens, delta.num_output_tokens, delta.num_cached_tokens)


async def create_chat_completion(state: FrontendState, body: ChatCompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    state.check_model(body.model)
    body.check_supported()
    max_tokens, max_tokens_param = body.requested_max_tokens()
    try:
        params = body.to_sampling_params(max_tokens)
    except InvalidRequestError as e:  # name the field the client actually sent
        if e.param == "max_tokens":
            e.param = max_tokens_param
        raise
    try:
        prompt_ids = await state.tokenizer_client.render_chat(
            body.template_messages(), add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs)
    except InvalidRequestError as e:  # the pool's reply names no parameter; the messages are at fault
        e.param = e.param or "messages"
        raise
    await state.generator.validate(prompt_ids, max_tokens, prompt_param="messages",
                                   max_tokens_param=max_tokens_param)
    await state.engine.ensure_connected()

    reply = _Reply(id=request_base_id(raw_request, "chatcmpl"), created=int(time.time()), model=state.model_name)
    request = GenerationRequest(
        request_id=reply.id, prompt_token_ids=prompt_ids, sampling_params=params, stop=body.stop_strings(),
        include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
        arrival_time=arrival, priority=body.priority, cache_salt=body.cache_salt)
    deltas = state.generator.generate(request)

    if body.stream:
        events = _stream(reply, deltas, body.include_usage_chunk(),
                         bool(body.stream_options and body.stream_options.continuous_usage_stats))
        return StreamingResponse(sse.with_error_events(events), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    completed, response = await cancel_on_disconnect(raw_request, _collect(reply, deltas))
    if not completed:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return JSONResponse(response.model_dump())


async def _collect(reply: _Reply, deltas: AsyncIterator[GenerationDelta]) -> ChatCompletionResponse:
    texts: list[str] = []
    last: GenerationDelta | None = None
    async with aclosing(deltas):
        async for delta in deltas:
            texts.append(delta.text)
            last = delta
    choice = ChatChoice(index=0, message=ChatMessage(role=ROLE, content="".join(texts)),
                        finish_reason=last.finish_reason if last else None,
                        stop_reason=last.stop_reason if last else None)
    return ChatCompletionResponse(id=reply.id, created=reply.created, model=reply.model,
                                  system_fingerprint=SYSTEM_FINGERPRINT, choices=[choice], usage=_usage(last))


async def _stream(reply: _Reply, deltas: AsyncIterator[GenerationDelta], include_usage: bool,
                  continuous_usage: bool) -> AsyncIterator[str]:
    last: GenerationDelta | None = None
    # The first chunk carries the role, as OpenAI's does.
    yield reply.chunk([ChatStreamChoice(index=0, delta=DeltaMessage(role=ROLE, content=""))],
                      _usage(None) if continuous_usage else None)
    async with aclosing(deltas):
        async for delta in deltas:
            last = delta
            if not delta.text and delta.finish_reason is None:
                continue  # e.g. text held back while it may begin a stop string
            choice = ChatStreamChoice(index=0, delta=DeltaMessage(content=delta.text or None),
                                      finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
            yield reply.chunk([choice], _usage(delta) if continuous_usage else None)
    if include_usage:
        yield reply.chunk([], _usage(last))
    yield sse.DONE
