"""From prompt token ids to text deltas: the part both APIs share.

`Generator.validate` checks a prompt before anything is sent (so errors are
plain HTTP 400s, never half a stream). `Generator.generate` sends the request
to the scheduler, detokenizes each sample incrementally, applies stop strings
(ending the sample early with finish reason "stop" and aborting it in the
scheduler), records latency metrics, and yields one `GenerationDelta` per
scheduler output. Closing the iterator early (client gone) aborts the request
in the scheduler.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from common.errors import InvalidRequestError
from common.protocol import RequestOutput, TokenLogprobs, sample_request_id
from common.sampling_params import MAX_LOGPROBS, SamplingParams
from common.structured_outputs import StructuredOutputs, check_grammar
from frontend.engine.control_client import ControlClient
from frontend.engine.engine_client import EngineClient
from frontend.engine.frontend_metrics import FrontendMetrics, RequestTimer
from common.output_decoder import DecodedDelta, OutputDecoder
from frontend.engine.generation_request import GenerationRequest
from frontend.engine.request_log import RequestLogger
from frontend.engine.token_texts import TokenTexts


@dataclass(slots=True)
class GenerationDelta:
    """What one scheduler output adds to one sample of a request."""
    index: int  # the sample (n > 1 / best_of), 0 otherwise
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (as reported so far)
    num_output_tokens: int  # of every sample so far, including token_ids
    logprobs: list[TokenLogprobs] | None = None  # for token_ids, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the sample's last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., once, when asked
    request_finished: bool = False  # the request's last delta

    def decoded(self) -> DecodedDelta:
        return DecodedDelta(self.token_ids, self.text, self.logprobs, self.finish_reason, self.stop_reason)


class Generator:
    def __init__(self, engine: EngineClient, tokenizer, control: ControlClient, metrics: FrontendMetrics,
                 request_logger: RequestLogger | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.control = control
        self.metrics = metrics
        self.request_logger = request_logger  # --enable-log-requests
        self.token_texts = TokenTexts(tokenizer)  # each token's text, for logprobs

    async def vocab_size(self) -> int:
        info = await self.control.model_info()
        return info.vocab_size if info is not None and info.vocab_size else len(self.tokenizer)

    async def max_logprobs(self) -> int:
        """The engine's --max-logprobs (its default until the scheduler has said)."""
        info = await self.control.model_info()
        return info.max_logprobs if info is not None and info.HasField("max_logprobs") else MAX_LOGPROBS

    async def validate(self, prompt_token_ids: list[int], max_tokens: int | None, *, min_tokens: int = 0,
                       prompt_param: str = "prompt", max_tokens_param: str = "max_tokens",
                       structured_output: tuple[StructuredOutputs, str] | None = None) -> None:
        """Reject prompts the scheduler would reject, with a message naming the
        limits, and structured outputs whose grammar is not valid (naming the
        field that asked for it)."""
        if structured_output is not None:
            spec, param = structured_output
            try:  # in a thread: the first use imports xgrammar (and torch), seconds
                await asyncio.to_thread(check_grammar, spec)
            except InvalidRequestError as e:
                e.param = param
                raise
        if not prompt_token_ids:
            raise InvalidRequestError("The prompt is empty: at least one token is required", param=prompt_param)
        info = await self.control.model_info()
        vocab_size = await self.vocab_size()
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
        if max_tokens is None and min_tokens > max_len - prompt_len:
            raise InvalidRequestError(
                f"min_tokens ({min_tokens}) is more than the {max_len - prompt_len} tokens that fit after the "
                f"{prompt_len}-token input in this model's maximum context length of {max_len} tokens",
                param="min_tokens", code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the "
                f"completion). Please reduce the length of the input or of {max_tokens_param}.",
                param=max_tokens_param if prompt_len < max_len else prompt_param,
                code="context_length_exceeded")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        stream = _SampleStreams(self.tokenizer, request)
        timer = RequestTimer(self.metrics, request.arrival_time)
        finished = False
        if self.request_logger is not None:
            self.request_logger.received(request)
        outputs = self.engine.generate(request.request_id, request.prompt_token_ids, request.sampling_params,
                                       priority=request.priority, cache_salt=request.cache_salt,
                                       **({"lora_request": request.lora_request} if request.lora_request else {}),
                                       **({"images": request.images} if request.images else {}))
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    now = time.monotonic()
                    timer.tokens_arrived(len(output.new_token_ids), now)
                    for delta in stream.add(output):
                        if delta.request_finished:
                            finished = True
                            timer.finished(delta.finish_reason or "abort", now)
                            self.log_finished(request, delta.finish_reason or "abort", delta.num_output_tokens)
                        yield delta
                    if finished:
                        # Leaving the loop closes `outputs`, which aborts the
                        # request in the scheduler if it is still running there.
                        return
                    if stream.stopped_samples:
                        self.engine.abort([sample_request_id(request.request_id, index)
                                           for index in stream.take_stopped_samples()])
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                timer.finished("abort", time.monotonic())  # the client went away
                self.log_finished(request, "abort (the client went away)", stream.num_output_tokens)
            raise
        except Exception as e:
            self.log_finished(request, f"failed ({e})", stream.num_output_tokens)
            raise

    def log_finished(self, request: GenerationRequest, reason: str, num_output_tokens: int) -> None:
        if self.request_logger is not None:
            self.request_logger.finished(request.request_id, reason, num_output_tokens)


class _SampleStreams:
    """A request's outputs, decoded per sample."""

    def __init__(self, tokenizer, request: GenerationRequest):
        self.tokenizer = tokenizer
        self.request = request
        self.num_samples = request.sampling_params.num_samples
        self.decoders: dict[int, OutputDecoder] = {}
        self.finished: set[int] = set()
        self.stopped_samples: list[int] = []  # ended here by a stop string: the scheduler should drop them
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def add(self, output: RequestOutput) -> list[GenerationDelta]:
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        index = output.index
        deltas = []
        if index not in self.finished:
            decoder = self.decoders.get(index)
            if decoder is None:
                decoder = self.decoders[index] = OutputDecoder(
                    self.tokenizer, self.request.prompt_token_ids, self.request.sampling_params)
            decoded = decoder.decode(output)
            self.num_output_tokens += len(decoded.token_ids)
            if decoded.finish_reason is not None:
                self.finished.add(index)
                if output.finish_reason is None and self.num_samples > 1:
                    self.stopped_samples.append(index)
            deltas.append(self._delta(index, decoded, output.prompt_logprobs))
        elif output.prompt_logprobs is not None:
            deltas.append(self._delta(index, DecodedDelta([], "", None), output.prompt_logprobs))
        if output.request_finished:
            # Samples the scheduler never started (the request was aborted early) end as aborted.
            for missing in sorted(set(range(self.num_samples)) - self.finished):
                self.finished.add(missing)
                deltas.append(self._delta(missing, DecodedDelta([], "", None, "abort"), None))
        if len(self.finished) == self.num_samples:
            if not deltas:
                deltas.append(self._delta(index, DecodedDelta([], "", None), None))
            deltas[-1].request_finished = True
        return [d for d in deltas if d.token_ids or d.text or d.finish_reason or d.prompt_logprobs is not None
                or d.request_finished]

    def take_stopped_samples(self) -> list[int]:
        stopped, self.stopped_samples = self.stopped_samples, []
        return stopped if len(self.finished) < self.num_samples else []

    def _delta(self, index: int, decoded: DecodedDelta,
               prompt_logprobs: list[TokenLogprobs] | None) -> GenerationDelta:
        return GenerationDelta(
            index=index, text=decoded.text, token_ids=decoded.token_ids,
            num_prompt_tokens=len(self.request.prompt_token_ids), num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens, logprobs=decoded.logprobs,
            finish_reason=decoded.finish_reason, stop_reason=decoded.stop_reason,
            prompt_logprobs=prompt_logprobs)
