"""POST /v1/chat/completions: messages rendered by the tokenizer pool, `n` choices."""
from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequestError
from common.protocol import ImageInput, TokenLogprobs
from common.sampling_params import SamplingParams
from frontend.openai import sse
from frontend.engine.beam_search_stream import beam_search_deltas, beam_search_params
from common.sample_choices import SampleResult, best_samples
from frontend.engine.generation import GenerationDelta
from frontend.engine.generation_request import GenerationRequest
from frontend.engine.token_texts import TokenTexts
from frontend.openai.logprobs_format import chat_logprobs, prompt_logprobs_json
from frontend.openai.request_bodies import ChatCompletionRequest, ChatTemplateRequest
from frontend.openai.response_bodies import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatMessage,
                                             ChatStreamChoice, DeltaMessage, UsageInfo)
from frontend.prompt_extras import truncated_prompt, with_bad_words_tokenized
from frontend.openai.http_replies import event_stream, json_reply
from frontend.frontend_state import SYSTEM_FINGERPRINT, FrontendState, request_ids
from frontend.openai.tool_call_stream import ToolCallStream, tool_call_stream
from frontend.openai.tool_calls import tool_call_reply


@dataclass(slots=True)
class _Reply:
    id: str
    created: int
    model: str
    body: ChatCompletionRequest
    texts: TokenTexts
    prompt_token_ids: list[int]
    params: SamplingParams | None = None  # what the engine runs (the model's defaults filled in)
    as_token_ids: bool = False  # logprobs name tokens "token_id:{id}"
    last: GenerationDelta | None = None  # carries the running usage counts

    def chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
              prompt_logprobs: list[TokenLogprobs] | None = None, with_prompt_token_ids: bool = False) -> str:
        return sse.event(ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices, usage=usage, prompt_logprobs=self.prompt_logprobs(prompt_logprobs),
            prompt_token_ids=self.token_ids(self.prompt_token_ids) if with_prompt_token_ids else None))

    def usage(self, completion_tokens: int | None = None) -> UsageInfo:
        """The request's usage; with `completion_tokens`, one choice's (continuous usage)."""
        last = self.last
        if completion_tokens is None:
            completion_tokens = last.num_output_tokens if last else 0
        return UsageInfo.of(len(self.prompt_token_ids), completion_tokens, last.num_cached_tokens if last else 0)

    def token_ids(self, token_ids: list[int]) -> list[int] | None:
        """`token_ids` when the client asked for them (vLLM's return_token_ids), else None."""
        return list(token_ids) if self.body.return_token_ids else None

    def logprobs(self, entries: list[TokenLogprobs] | None):
        return chat_logprobs(entries or [], self.texts, self.as_token_ids) if self.body.logprobs else None

    def prompt_logprobs(self, entries: list[TokenLogprobs] | None):
        if self.body.prompt_logprobs is None or entries is None:
            return None
        return prompt_logprobs_json(entries, self.texts)


async def create_chat_completion(state: FrontendState, body: ChatCompletionRequest, raw_request: Request) -> Response:
    reply, deltas = await start_chat_generation(state, body, raw_request, "chatcmpl-")
    if body.stream:
        return event_stream(_stream(reply, deltas))
    return await json_reply(raw_request, collect_chat_completion(reply, deltas))


async def start_chat_generation(state: FrontendState, body: ChatCompletionRequest, raw_request: Request,
                                id_prefix: str) -> tuple[_Reply, AsyncIterator[GenerationDelta]]:
    """Check the request, render its prompt and start generating (also the Responses
    API's way in): every error here is a plain 400, before any output."""
    arrival = time.monotonic()
    state.check_model(body.model)
    body.enable_auto_tools(state.tool_call_parser)
    body.use_response_role(state.response_role)
    body.check_supported()
    generator = state.generator
    max_logprobs = await generator.max_logprobs()
    params = await with_bad_words_tokenized(state, body.sampling_params(
        await generator.vocab_size(), state.sampling_defaults, max_logprobs=max_logprobs))
    max_tokens, max_tokens_param = body.requested_max_tokens()
    beams = beam_search_params(body, max_tokens, max_logprobs)
    prompt_ids, images = await render_chat_prompt(state, body)
    if images and (params.truncate_prompt_tokens is not None or beams is not None):
        raise InvalidRequestError("truncate_prompt_tokens and beam search do not take images",
                                  param="truncate_prompt_tokens" if beams is None else "use_beam_search")
    prompt_ids = await truncated_prompt(state, prompt_ids, params)
    await generator.validate(prompt_ids, max_tokens, min_tokens=params.min_tokens, prompt_param="messages",
                             max_tokens_param=max_tokens_param, structured_output=body.structured_output())
    await state.engine.ensure_connected()

    response_id, engine_id = request_ids(raw_request, id_prefix)
    reply = _Reply(id=response_id, created=int(time.time()), model=state.model_name,
                   body=body, texts=generator.token_texts, prompt_token_ids=prompt_ids, params=params,
                   as_token_ids=body.tokens_as_ids(state.return_tokens_as_token_ids))
    request = GenerationRequest(request_id=engine_id, prompt_token_ids=prompt_ids, sampling_params=params,
                                arrival_time=arrival, priority=body.priority, cache_salt=body.cache_salt,
                                lora_request=state.lora_request(body.model), images=images)
    return reply, generator.generate(request) if beams is None else beam_search_deltas(generator, request, beams)


async def render_chat_prompt(state: FrontendState, body: ChatTemplateRequest) -> tuple[list[int], list[ImageInput]]:
    """The prompt's token ids and images: the messages through the chat template, in the tokenizer
    pool (which decodes the image parts and expands their placeholders)."""
    if (count := body.num_images()) > state.image_limit:
        raise InvalidRequestError(f"{count} images in one prompt; at most {state.image_limit} "
                                  "(--limit-mm-per-prompt)", param="messages")
    try:
        reply = await state.tokenizer_client.render_chat_reply(
            body.template_messages(), add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template_kwargs=body.template_kwargs(),
            add_special_tokens=bool(body.add_special_tokens))
    except InvalidRequestError as e:  # the pool's reply names no parameter; the messages are at fault
        e.param = e.param or "messages"
        raise
    return reply.token_ids, reply.images


async def collect_chat_completion(reply: _Reply, deltas: AsyncIterator[GenerationDelta]) -> ChatCompletionResponse:
    """The whole reply, once every sample has finished."""
    samples = [SampleResult(i) for i in range(reply.body.best_of or reply.body.n)]
    prompt_logprobs = None
    async with aclosing(deltas):
        async for delta in deltas:
            reply.last = delta
            prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else prompt_logprobs
            samples[delta.index].add(delta.decoded())
    echo, role = reply.body.echoed_text(), reply.body.response_role()
    tool_choice = reply.body.resolved_tool_choice()
    choices = []
    for rank, sample in enumerate(best_samples(samples, reply.body.n)):
        message, finish_reason = ChatMessage(role=role, content=echo + sample.text), sample.finish_reason
        if (calls := tool_call_reply(sample.text, finish_reason, tool_choice)) is not None:
            message = ChatMessage(role=role, content=calls.content, tool_calls=calls.tool_calls)
            finish_reason = calls.finish_reason
        choices.append(ChatChoice(index=rank, message=message, logprobs=reply.logprobs(sample.logprobs),
                                  finish_reason=finish_reason, stop_reason=sample.stop_reason,
                                  token_ids=reply.token_ids(sample.token_ids)))
    return ChatCompletionResponse(id=reply.id, created=reply.created, model=reply.model,
                                  system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=reply.usage(),
                                  prompt_logprobs=reply.prompt_logprobs(prompt_logprobs),
                                  prompt_token_ids=reply.token_ids(reply.prompt_token_ids))


@dataclass(slots=True)
class _Held:
    """Logprobs and ids of tokens whose text is not sent yet (held back, or no text),
    and the reply's tool calls as they stream (None: plain text)."""
    calls: ToolCallStream | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # the choice's output tokens so far (its continuous usage, as vLLM's)


async def _stream(reply: _Reply, deltas: AsyncIterator[GenerationDelta]) -> AsyncIterator[str]:
    body = reply.body
    continuous = body.continuous_usage()
    # Each choice's first chunk carries the role (and vLLM's echo), as OpenAI's does.
    echo, role = body.echoed_text(), body.response_role()
    for index in range(body.n):
        yield reply.chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role=role, content=echo))],
                          reply.usage(0) if continuous else None, with_prompt_token_ids=index == 0)
    tool_choice = body.resolved_tool_choice()
    held = [_Held(tool_call_stream(tool_choice)) for _ in range(body.n)]
    async with aclosing(deltas):
        async for delta in deltas:
            reply.last = delta
            pending = held[delta.index]
            pending.logprobs += delta.logprobs or []
            pending.token_ids += delta.token_ids
            pending.num_tokens += len(delta.token_ids)
            message, finish_reason = DeltaMessage(content=delta.text or None), delta.finish_reason
            if pending.calls is not None:
                # Content up to the calls, then each call's header and arguments as they come.
                step = pending.calls.feed(delta.text) if finish_reason is None else \
                    pending.calls.finish(delta.text, finish_reason)
                message = DeltaMessage(content=step.content or None, tool_calls=step.tool_calls or None)
                finish_reason = step.finish_reason
            if message.content is None and message.tool_calls is None and finish_reason is None \
                    and delta.prompt_logprobs is None:
                continue  # e.g. text held back while it may begin a stop string or a tool call tag
            choice = ChatStreamChoice(index=delta.index, delta=message,
                                      logprobs=reply.logprobs(pending.logprobs) if pending.logprobs else None,
                                      finish_reason=finish_reason, stop_reason=delta.stop_reason,
                                      token_ids=reply.token_ids(pending.token_ids))
            pending.logprobs, pending.token_ids = [], []
            yield reply.chunk([choice], reply.usage(pending.num_tokens) if continuous else None, delta.prompt_logprobs)
    if body.include_usage_chunk():
        yield reply.chunk([], reply.usage())
    yield sse.DONE
