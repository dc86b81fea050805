"""POST /v1/completions: one choice per prompt (a string, token ids, or a list of either)."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend import sse
from frontend.async_utils import cancel_on_disconnect, merge_async_iterators
from frontend.generation import GenerationDelta, GenerationRequest
from frontend.openai_protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from frontend.state import SYSTEM_FINGERPRINT, FrontendState, request_base_id


@dataclass(slots=True)
class _Reply:
    """What every chunk of one response shares."""
    id: str
    created: int
    model: str

    def response(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=usage)


class _UsageTally:
    def __init__(self, num_choices: int):
        self.last: list[GenerationDelta | None] = [None] * num_choices

    def add(self, index: int, delta: GenerationDelta) -> None:
        self.last[index] = delta

    def usage(self, index: int | None = None) -> UsageInfo:
        deltas = [d for d in (self.last if index is None else [self.last[index]]) if d is not None]
        return UsageInfo.of(sum(d.num_prompt_tokens for d in deltas), sum(d.num_output_tokens for d in deltas),
                            sum(d.num_cached_tokens for d in deltas))


async def create_completion(state: FrontendState, body: CompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    state.check_model(body.model)
    body.check_supported()
    params = body.to_sampling_params(body.max_tokens)
    prompts = body.prompts()
    prompt_ids = await asyncio.gather(*(_prompt_token_ids(state, p, body.add_special_tokens) for p in prompts))
    for ids in prompt_ids:
        await state.generator.validate(ids, body.max_tokens)
    await state.engine.ensure_connected()

    reply = _Reply(id=request_base_id(raw_request, "cmpl"), created=int(time.time()), model=state.model_name)
    requests = [GenerationRequest(
        request_id=f"{reply.id}-{i}", prompt_token_ids=ids, sampling_params=params, stop=body.stop_strings(),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens, arrival_time=arrival, priority=body.priority,
        cache_salt=body.cache_salt) for i, ids in enumerate(prompt_ids)]
    echo = [p if isinstance(p, str) else state.tokenizer.decode(ids)
            for p, ids in zip(prompts, prompt_ids)] if body.echo else None
    merged = merge_async_iterators([state.generator.generate(r) for r in requests])

    if body.stream:
        events = _stream(reply, merged, len(requests), echo, body.include_usage_chunk(),
                         bool(body.stream_options and body.stream_options.continuous_usage_stats))
        return StreamingResponse(sse.with_error_events(events), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    completed, response = await cancel_on_disconnect(raw_request, _collect(reply, merged, len(requests), echo))
    if not completed:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return JSONResponse(response.model_dump())


async def _prompt_token_ids(state: FrontendState, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        return await state.tokenizer_client.encode(prompt, add_special_tokens=add_special_tokens)
    return list(prompt)


async def _collect(reply: _Reply, merged: AsyncIterator[tuple[int, GenerationDelta]], num_choices: int,
                   echo: list[str] | None) -> CompletionResponse:
    texts: list[list[str]] = [[echo[i]] if echo else [] for i in range(num_choices)]
    tally = _UsageTally(num_choices)
    async with aclosing(merged):
        async for index, delta in merged:
            texts[index].append(delta.text)
            tally.add(index, delta)
    choices = [CompletionChoice(index=i, text="".join(texts[i]), finish_reason=last.finish_reason,
                                stop_reason=last.stop_reason) for i, last in enumerate(tally.last)]
    return reply.response(choices, tally.usage())


async def _stream(reply: _Reply, merged: AsyncIterator[tuple[int, GenerationDelta]], num_choices: int,
                  echo: list[str] | None, include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    tally = _UsageTally(num_choices)
    pending_echo = list(echo) if echo else [""] * num_choices
    async with aclosing(merged):
        async for index, delta in merged:
            tally.add(index, delta)
            text = pending_echo[index] + delta.text
            pending_echo[index] = ""
            if not text and delta.finish_reason is None:
                continue  # e.g. text held back while it may begin a stop string
            choice = CompletionChoice(index=index, text=text, finish_reason=delta.finish_reason,
                                      stop_reason=delta.stop_reason)
            yield sse.event(reply.response([choice], tally.usage(index) if continuous_usage else None))
    if include_usage:
        yield sse.event(reply.response([], tally.usage()))
    yield sse.DONE
