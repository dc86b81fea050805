"""POST /v1/completions: `n` choices per prompt (a string, token ids, or a list
of either), numbered as OpenAI does: prompt_index * n + sample_index."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from common.protocol import TokenLogprobs
from frontend.openai import sse
from frontend.openai.async_utils import merge_async_iterators
from frontend.engine.beam_search_stream import beam_search_deltas, beam_search_params
from common.sample_choices import SampleResult, best_samples
from frontend.engine.generation import GenerationDelta
from frontend.engine.generation_request import GenerationRequest
from frontend.engine.token_texts import TokenTexts
from frontend.openai.logprobs_format import completion_logprobs, prompt_logprobs_json
from frontend.openai.request_bodies import CompletionRequest
from frontend.openai.response_bodies import CompletionChoice, CompletionResponse, UsageInfo
from common.output_decoder import DecodedDelta
from frontend.prompt_extras import echoed_prompt, encoded_prompt, with_bad_words_tokenized
from frontend.openai.http_replies import event_stream, json_reply
from frontend.frontend_state import SYSTEM_FINGERPRINT, FrontendState, request_ids


@dataclass(slots=True)
class _Prompt:
    """One prompt of the request and what its samples report."""
    token_ids: list[int]
    echo: str | None  # the prompt text, when echo is on
    prompt_logprobs: list[TokenLogprobs] | None = None
    last: GenerationDelta | None = None  # carries the running usage counts
    samples: list[SampleResult] = field(default_factory=list)


@dataclass(slots=True)
class _Reply:
    """What every chunk of one response shares."""
    id: str
    created: int
    model: str
    body: CompletionRequest
    texts: TokenTexts
    prompts: list[_Prompt]
    as_token_ids: bool = False  # logprobs name tokens "token_id:{id}"

    def response(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=usage)

    def usage(self) -> UsageInfo:
        seen = [p.last for p in self.prompts if p.last is not None]
        generated = 0 if self.body.echo_only else sum(d.num_output_tokens for d in seen)
        return UsageInfo.of(sum(len(p.token_ids) for p in self.prompts), generated,
                            sum(d.num_cached_tokens for d in seen))

    @staticmethod
    def choice_usage(prompt: _Prompt, completion_tokens: int) -> UsageInfo:
        """Continuous usage: as vLLM's, the chunk's prompt and its choice's tokens so far."""
        cached = prompt.last.num_cached_tokens if prompt.last is not None else 0
        return UsageInfo.of(len(prompt.token_ids), completion_tokens, cached)

    def logprobs(self, prompt: _Prompt, token_ids: list[int], entries: list[TokenLogprobs] | None,
                 with_echo: bool, text_offset: int = 0):
        """The legacy logprobs object of a choice (or of one stream chunk)."""
        if self.body.logprobs is None:
            return None
        entries = list(entries or [])
        if with_echo:  # the echoed prompt's tokens come first; its first token has no logprob
            token_ids = prompt.token_ids + token_ids
            entries = [None, *(prompt.prompt_logprobs or [])] + entries
        return completion_logprobs(token_ids, entries, self.texts, text_offset, self.as_token_ids)

    def prompt_logprobs(self, prompt: _Prompt):
        if self.body.prompt_logprobs is None or prompt.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(prompt.prompt_logprobs, self.texts)

    def token_ids(self, token_ids: list[int]) -> list[int] | None:
        """`token_ids` when the client asked for them (vLLM's return_token_ids), else None."""
        return list(token_ids) if self.body.return_token_ids else None


async def create_completion(state: FrontendState, body: CompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    state.check_model(body.model)
    body.check_supported()
    generator = state.generator
    max_logprobs = await generator.max_logprobs()
    params = await with_bad_words_tokenized(state, body.sampling_params(
        await generator.vocab_size(), state.sampling_defaults, max_logprobs=max_logprobs))
    beams = beam_search_params(body, body.max_tokens, max_logprobs)
    prompts = body.prompts()
    encoded = await asyncio.gather(*(encoded_prompt(state, p, body.add_special_tokens, params) for p in prompts))
    prompt_ids = [ids for ids, _ in encoded]
    structured_output = body.structured_output()
    for ids in prompt_ids:
        await generator.validate(ids, params.max_tokens, min_tokens=params.min_tokens,
                                 structured_output=structured_output)
    await state.engine.ensure_connected()

    response_id, engine_id = request_ids(raw_request, "cmpl-")
    reply = _Reply(id=response_id, created=int(time.time()), model=state.model_name, body=body,
                   texts=generator.token_texts, prompts=[
                       _Prompt(ids, echoed_prompt(state, p, ids, whole) if body.echo else None,
                               samples=[SampleResult(i) for i in range(params.num_samples)])
                       for p, (ids, whole) in zip(prompts, encoded)],
                   as_token_ids=body.tokens_as_ids(state.return_tokens_as_token_ids))
    requests = [GenerationRequest(
        request_id=f"{engine_id}-{i}", prompt_token_ids=ids, sampling_params=params, arrival_time=arrival,
        priority=body.priority, cache_salt=body.cache_salt, lora_request=state.lora_request(body.model))
        for i, ids in enumerate(prompt_ids)]
    merged = merge_async_iterators([generator.generate(r) if beams is None else beam_search_deltas(generator, r, beams)
                                    for r in requests])

    if body.stream:
        return event_stream(_stream(reply, merged))
    return await json_reply(raw_request, _collect(reply, merged))


def _note(prompt: _Prompt, delta: GenerationDelta) -> None:
    prompt.last = delta
    if delta.prompt_logprobs is not None:
        prompt.prompt_logprobs = delta.prompt_logprobs


async def _collect(reply: _Reply, merged: AsyncIterator[tuple[int, GenerationDelta]]) -> CompletionResponse:
    async with aclosing(merged):
        async for prompt_index, delta in merged:
            prompt = reply.prompts[prompt_index]
            _note(prompt, delta)
            prompt.samples[delta.index].add(_shown(reply.body, delta.decoded()))
    n = reply.body.n
    choices = []
    for prompt_index, prompt in enumerate(reply.prompts):
        for rank, sample in enumerate(best_samples(prompt.samples, n)):
            echo = prompt.echo or ""
            choices.append(CompletionChoice(
                index=prompt_index * n + rank, text=echo + sample.text, finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason, prompt_logprobs=reply.prompt_logprobs(prompt),
                logprobs=reply.logprobs(prompt, sample.token_ids, sample.logprobs, prompt.echo is not None),
                prompt_token_ids=reply.token_ids(prompt.token_ids), token_ids=reply.token_ids(sample.token_ids)))
    return reply.response(choices, reply.usage())


def _shown(body: CompletionRequest, decoded: DecodedDelta) -> DecodedDelta:
    """What a choice shows of a sample's delta: with echo_only the one token generated
    for the prompt's logprobs is not part of it, and the sample ends at max_tokens 0."""
    if not body.echo_only:
        return decoded
    return DecodedDelta([], "", [], None if decoded.finish_reason is None else "length")


@dataclass(slots=True)
class _ChoiceStream:
    """A streamed choice: text sent so far, and tokens whose text is held back."""
    sent_chars: int = 0
    started: bool = False
    num_tokens: int = 0  # output tokens shown so far (for continuous usage)
    held_token_ids: list[int] = field(default_factory=list)
    held_logprobs: list[TokenLogprobs] = field(default_factory=list)


async def _stream(reply: _Reply, merged: AsyncIterator[tuple[int, GenerationDelta]]) -> AsyncIterator[str]:
    n = reply.body.n
    streams = [_ChoiceStream() for _ in range(len(reply.prompts) * n)]
    async with aclosing(merged):
        async for prompt_index, delta in merged:
            prompt = reply.prompts[prompt_index]
            _note(prompt, delta)
            choice = streams[prompt_index * n + delta.index]
            shown = _shown(reply.body, delta.decoded())
            choice.held_token_ids += shown.token_ids
            choice.num_tokens += len(shown.token_ids)
            choice.held_logprobs += shown.logprobs or []
            with_echo = prompt.echo is not None and not choice.started
            text = (prompt.echo if with_echo else "") + shown.text
            if not text and delta.finish_reason is None:
                continue  # e.g. text held back while it may begin a stop string
            logprobs = reply.logprobs(prompt, choice.held_token_ids, choice.held_logprobs, with_echo,
                                      choice.sent_chars)
            body = CompletionChoice(
                index=prompt_index * n + delta.index, text=text, logprobs=logprobs,
                finish_reason=shown.finish_reason, stop_reason=shown.stop_reason,
                prompt_logprobs=reply.prompt_logprobs(prompt) if not choice.started else None,
                prompt_token_ids=reply.token_ids(prompt.token_ids) if not choice.started else None,
                token_ids=reply.token_ids(choice.held_token_ids))
            choice.started, choice.sent_chars = True, choice.sent_chars + len(text)
            choice.held_token_ids, choice.held_logprobs = [], []
            usage = reply.choice_usage(prompt, choice.num_tokens) if reply.body.continuous_usage() else None
            yield sse.event(reply.response([body], usage))
    if reply.body.include_usage_chunk():
        yield sse.event(reply.response([], reply.usage()))
    yield sse.DONE
