"""The offline LLM's results: per-request tracking of samples, stop strings
and logprobs, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import RequestOutput, TokenLogprobs, sample_request_id
from common.sampling_params import SamplingParams
from common.sample_choices import SampleResult, best_samples
from common.output_decoder import DecodedDelta, OutputDecoder, stop_token_reason


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked
    cumulative_logprob: float | None = None  # when logprobs were asked


@dataclass(slots=True)
class GenerationOutput:
    """One prompt's result, shaped like vLLM's RequestOutput."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # None first: the first token has none


class OfflineRequest:
    """Collects one request's engine outputs into its samples."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer):
        self.request_id = request_id
        self.params = params
        self.result = GenerationOutput(request_id, prompt, prompt_token_ids, [], finished=False)
        self.samples = [SampleResult(i) for i in range(params.num_samples)]
        self._decoders = [OutputDecoder(tokenizer, prompt_token_ids, params) if tokenizer is not None else None
                          for _ in self.samples]

    @property
    def finished(self) -> bool:
        return self.result.finished

    def add(self, output: RequestOutput) -> list[str]:
        """Record an output; returns the scheduler ids to abort (samples that
        a stop string ended, or the whole request once every sample ended)."""
        result = self.result
        result.num_cached_tokens = max(result.num_cached_tokens, output.num_cached_tokens)
        if output.prompt_logprobs is not None:
            result.prompt_logprobs = [None, *output.prompt_logprobs]
        sample = self.samples[output.index]
        to_abort: list[str] = []
        if not sample.finished:
            decoder = self._decoders[output.index]
            delta = decoder.decode(output) if decoder is not None else DecodedDelta(
                output.new_token_ids, "", output.logprobs,
                output.finish_reason.openai_name if output.finish_reason is not None else None,
                stop_token_reason(output, self.params.stop_token_ids))
            sample.add(delta)
            if sample.finished and output.finish_reason is None and self.params.num_samples > 1:
                to_abort.append(sample_request_id(self.request_id, output.index))  # a stop string ended it
        if output.request_finished:
            for other in self.samples:  # samples the scheduler never started (aborted early)
                if not other.finished:
                    other.finish_reason = "abort"
        if all(s.finished for s in self.samples):
            if not output.request_finished:
                to_abort = [self.request_id]
            self._finish()
        return to_abort

    def _finish(self) -> None:
        show_logprobs = self.params.logprobs is not None
        self.result.outputs = [
            CompletionOutput(index, sample.text, sample.token_ids, sample.finish_reason, sample.stop_reason,
                             sample.logprobs if show_logprobs else None,
                             sample.cumulative_logprob if show_logprobs else None)
            for index, sample in enumerate(best_samples(self.samples, self.params.n))]
        self.result.finished = True
