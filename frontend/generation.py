"""From prompt token ids to text deltas: the part both APIs share.

`Generator.validate` checks a prompt before anything is sent (so errors are
plain HTTP 400s, never half a stream). `Generator.generate` sends the request
to the scheduler, detokenizes incrementally, applies stop strings (ending the
request early with finish reason "stop"), records latency metrics, and
yields one `GenerationDelta` per scheduler output. Closing the iterator early
(client gone) aborts the request in the scheduler.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from common.detokenizer import IncrementalDetokenizer
from common.errors import InvalidRequestError
from common.protocol import FinishReason, RequestOutput
from common.sampling_params import SamplingParams
from frontend.control_client import ControlClient
from frontend.engine_client import EngineClient
from frontend.metrics import FrontendMetrics, RequestTimer
from frontend.stop_checker import StopChecker


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class GenerationDelta:
    """What one scheduler output adds to a request's result."""
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (as reported so far)
    num_output_tokens: int  # so far, including token_ids
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class Generator:
    def __init__(self, engine: EngineClient, tokenizer, control: ControlClient, metrics: FrontendMetrics):
        self.engine = engine
        self.tokenizer = tokenizer
        self.control = control
        self.metrics = metrics

    async def validate(self, prompt_token_ids: list[int], max_tokens: int | None, *,
                       prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> None:
        """Reject prompts the scheduler would reject, with a message naming the limits."""
        if not prompt_token_ids:
            raise InvalidRequestError("The prompt is empty: at least one token is required", param=prompt_param)
        info = await self.control.model_info()
        vocab_size = info.vocab_size if info is not None and info.vocab_size else len(self.tokenizer)
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"Token id {bad} is out of vocabulary (size {vocab_size})", param=prompt_param)
        if info is None or not info.max_model_len:
            return  # not known yet: the scheduler checks the length itself
        max_len, prompt_len = info.max_model_len, len(prompt_token_ids)
        if max_tokens is None and prompt_len >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{prompt_len} input tokens, leaving no room for output. Please reduce the length of the "
                f"input.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the "
                f"completion). Please reduce the length of the input or of {max_tokens_param}.",
                param=max_tokens_param if prompt_len < max_len else prompt_param,
                code="context_length_exceeded")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        decoder = _OutputDecoder(self.tokenizer, request)
        timer = RequestTimer(self.metrics, request.arrival_time)
        num_output_tokens = num_cached_tokens = 0
        finished = False
        outputs = self.engine.generate(request.request_id, request.prompt_token_ids, request.sampling_params,
                                       priority=request.priority, cache_salt=request.cache_salt)
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    timer.tokens_arrived(len(output.new_token_ids), time.monotonic())
                    token_ids, text, finish_reason, stop_reason = decoder.decode(output)
                    num_output_tokens += len(token_ids)
                    num_cached_tokens = max(num_cached_tokens, output.num_cached_tokens)
                    if finish_reason is not None:
                        finished = True
                        timer.finished(finish_reason, time.monotonic())
                    yield GenerationDelta(text=text, token_ids=token_ids,
                                          num_prompt_tokens=len(request.prompt_token_ids),
                                          num_cached_tokens=num_cached_tokens,
                                          num_output_tokens=num_output_tokens,
                                          finish_reason=finish_reason, stop_reason=stop_reason)
                    if finished:
                        # Leaving the loop closes `outputs`, which aborts the
                        # request in the scheduler if it is still running there.
                        return
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                timer.finished("abort", time.monotonic())  # the client went away
            raise


class _OutputDecoder:
    """Token ids to text for one request: incremental detokenization, then stop strings."""

    def __init__(self, tokenizer, request: GenerationRequest):
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                  skip_special_tokens=request.skip_special_tokens)
        self.stop_checker = StopChecker(request.stop, request.include_stop_str_in_output)
        self.include_stop_str_in_output = request.include_stop_str_in_output
        self.stop_token_ids = request.sampling_params.stop_token_ids

    def decode(self, output: RequestOutput) -> tuple[list[int], str, str | None, str | int | None]:
        """(the output's tokens that count, their text, finish reason, stop reason)."""
        stop_checker = self.stop_checker
        new_ids = output.new_token_ids
        # A STOP from the scheduler means the last token is EOS or a stop token
        # id: counted, but not part of the text (as in vLLM).
        hidden_index = (len(new_ids) - 1 if output.finish_reason == FinishReason.STOP
                        and not self.include_stop_str_in_output else -1)
        token_ids: list[int] = []
        pieces: list[str] = []
        for index, token_id in enumerate(new_ids):
            token_ids.append(token_id)
            if index == hidden_index:
                break
            pieces.append(stop_checker.feed(self.detokenizer.add_tokens([token_id])))
            if stop_checker.matched is not None:  # tokens after a stop string are not output
                return token_ids, "".join(pieces), "stop", stop_checker.matched
        if output.finish_reason is None:
            return token_ids, "".join(pieces), None, None
        pieces.append(stop_checker.feed(self.detokenizer.flush()))  # a last unfinished character
        if stop_checker.matched is not None:
            return token_ids, "".join(pieces), "stop", stop_checker.matched
        pieces.append(stop_checker.flush())
        stop_token = token_ids[-1] if (output.finish_reason == FinishReason.STOP and token_ids
                                       and token_ids[-1] in self.stop_token_ids) else None
        return token_ids, "".join(pieces), output.finish_reason.openai_name, stop_token
