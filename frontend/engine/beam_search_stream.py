"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions.

`n` is the beam width and the number of choices, best first; `length_penalty`
weighs the score (`common.beam_search`). The search runs here, one engine
request per live beam and step (each a one-token generation whose top
logprobs rank the candidates; the prefix cache keeps their prompts cheap),
and its result comes out as ordinary `GenerationDelta`s, one per choice, so
the APIs shape it (whole or streamed) as any other reply. Fields that would
change the scores or need the tokens one by one (logprobs, stop strings,
penalties, structured outputs, ...) are a 400 with beam search.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from common.beam_search import Beam, BeamSearch, BeamSearchParams
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from frontend.api_errors import ServiceUnavailableError
from frontend.engine.generation import GenerationDelta, Generator
from frontend.engine.generation_request import GenerationRequest
from frontend.engine.frontend_metrics import RequestTimer

# Request fields beam search cannot honour, and their defaults.
_NOT_WITH_BEAM_SEARCH = {
    "best_of": None, "logprobs": (None, False), "top_logprobs": None, "prompt_logprobs": None, "stop": (None, []),
    "stop_token_ids": (None, []), "logit_bias": (None, {}), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "min_tokens": 0,
    "allowed_token_ids": None, "bad_words": (None, []),
}


def beam_search_params(body: Any, max_tokens: int | None, max_logprobs: int) -> BeamSearchParams | None:
    """The beam search a request asks for (None: it samples as usual); a 400 naming
    the field when it also asks for something beam search cannot do."""
    if not body.use_beam_search:
        return None
    for name, default in _NOT_WITH_BEAM_SEARCH.items():
        value = getattr(body, name, None)
        if value not in (default if isinstance(default, tuple) else (default,)):
            raise InvalidRequestError(f"{name} cannot be used with beam search", param=name)
    if (asked := body.structured_output()) is not None:
        raise InvalidRequestError(f"{asked[1]} (a structured output) cannot be used with beam search",
                                  param=asked[1])
    params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                              length_penalty=body.length_penalty,
                              include_stop_str_in_output=body.include_stop_str_in_output)
    params.validate(max_logprobs)
    return params


async def beam_search_deltas(generator: Generator, request: GenerationRequest,
                             params: BeamSearchParams) -> AsyncIterator[GenerationDelta]:
    """The search's choices, best first, as one finished delta each."""
    info = await generator.control.model_info()
    if info is None or not info.max_model_len:
        raise ServiceUnavailableError("the model's shape is not known yet (no worker has registered)")
    prompt = request.prompt_token_ids
    search = BeamSearch(params, len(prompt), set(info.eos_token_ids), info.max_model_len)
    step_params = params.step_params()
    # The client's request is measured and logged as one, not as its many one-token steps.
    timer = RequestTimer(generator.metrics, request.arrival_time)
    if generator.request_logger is not None:
        generator.request_logger.received(request)
    try:
        while not search.done:
            inputs = search.next_inputs(prompt)
            search.advance(await asyncio.gather(*(
                _top_tokens(generator, request, f"{request.request_id}-beam{search.steps}-{i}", ids, step_params)
                for i, ids in enumerate(inputs))))
    except (asyncio.CancelledError, GeneratorExit):
        timer.finished("abort", time.monotonic())
        generator.log_finished(request, "abort (the client went away)", 0)
        raise
    except Exception as e:
        generator.log_finished(request, f"failed ({e})", 0)
        raise
    beams = search.results()
    outputs = [search.output_token_ids(beam) for beam in beams]
    now, reason = time.monotonic(), "stop" if beams[0].finished_by_eos else "length"
    timer.tokens_arrived(sum(map(len, outputs)), now)
    timer.finished(reason, now)
    generator.log_finished(request, reason, sum(map(len, outputs)))
    num_output_tokens = 0
    for index, (beam, token_ids) in enumerate(zip(beams, outputs)):
        num_output_tokens += len(token_ids)
        yield _choice(generator, request, index, beam, token_ids, num_output_tokens, last=index == len(beams) - 1)


async def _top_tokens(generator: Generator, request: GenerationRequest, step_id: str, token_ids: list[int],
                      params: SamplingParams) -> list[tuple[int, float]]:
    """The most likely next tokens after `token_ids`, as (token id, logprob)."""
    outputs = generator.engine.generate(step_id, token_ids, params, priority=request.priority,
                                        cache_salt=request.cache_salt)
    async with aclosing(outputs):
        async for output in outputs:
            if output.logprobs:
                entry = output.logprobs[0]
                return list(zip(entry.top_token_ids, entry.top_logprobs))
    raise ServiceUnavailableError(f"beam search step {step_id} ended without a token")


def _choice(generator: Generator, request: GenerationRequest, index: int, beam: Beam, token_ids: list[int],
            num_output_tokens: int, last: bool) -> GenerationDelta:
    skip = request.sampling_params.skip_special_tokens
    return GenerationDelta(
        index=index, text=generator.tokenizer.decode(token_ids, skip_special_tokens=skip), token_ids=token_ids,
        num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=0, num_output_tokens=num_output_tokens,
        finish_reason="stop" if beam.finished_by_eos else "length", request_finished=last)
