"""Turning one sample's engine outputs into text: incremental detokenization,
stop strings, and which tokens (and logprobs) count.

Pure Python (no server imports): the offline `LLM` uses it as well, so both
produce the same text for the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.detokenizer import IncrementalDetokenizer
from common.protocol import FinishReason, RequestOutput, TokenLogprobs
from common.sampling_params import SamplingParams
from common.stop_checker import StopChecker


@dataclass(slots=True)
class DecodedDelta:
    """What one engine output adds to a sample."""
    token_ids: list[int]  # the output's tokens that count (none after a stop string)
    text: str
    logprobs: list[TokenLogprobs] | None  # for token_ids, when the request asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" when the sample ended
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class OutputDecoder:
    """One sample's decoder. A STOP from the scheduler means the last token
    is EOS or a stop token id: counted, but not part of the text unless
    include_stop_str_in_output (as vLLM)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_token_ids = params.stop_token_ids
        self.min_tokens = params.min_tokens
        self.num_tokens = 0  # output tokens so far

    def decode(self, output: RequestOutput) -> DecodedDelta:
        stop_checker = self.stop_checker
        new_ids = output.new_token_ids
        hidden_index = (len(new_ids) - 1 if output.finish_reason == FinishReason.STOP
                        and not self.include_stop_str_in_output else -1)
        pieces: list[str] = []
        count = 0
        for index, token_id in enumerate(new_ids):
            count += 1
            self.num_tokens += 1
            if index == hidden_index:
                break
            # As vLLM: stop strings count only once min_tokens tokens are out (as EOS and stop token ids).
            pieces.append(stop_checker.feed(self.detokenizer.add_tokens([token_id]),
                                            check=self.num_tokens > self.min_tokens))
            if stop_checker.matched is not None:  # tokens after a stop string are not output
                return self._delta(output, count, pieces, "stop", stop_checker.matched)
        if output.finish_reason is None:
            return self._delta(output, count, pieces, None, None)
        pieces.append(stop_checker.feed(self.detokenizer.flush(),  # a last unfinished character
                                        check=self.num_tokens > self.min_tokens))
        if stop_checker.matched is not None:
            return self._delta(output, count, pieces, "stop", stop_checker.matched)
        pieces.append(stop_checker.flush())
        return self._delta(output, count, pieces, output.finish_reason.openai_name,
                           stop_token_reason(output, self.stop_token_ids))

    @staticmethod
    def _delta(output: RequestOutput, count: int, pieces: list[str], finish_reason: str | None,
               stop_reason: str | int | None) -> DecodedDelta:
        logprobs = output.logprobs[:count] if output.logprobs is not None else None
        return DecodedDelta(output.new_token_ids[:count], "".join(pieces), logprobs, finish_reason, stop_reason)


def stop_token_reason(output: RequestOutput, stop_token_ids: list[int]) -> int | None:
    """The stop token id that ended the sample with this output, if one did (vLLM's
    `stop_reason`; None for EOS, a length limit or a stop string)."""
    new_ids = output.new_token_ids
    if output.finish_reason == FinishReason.STOP and new_ids and new_ids[-1] in stop_token_ids:
        return new_ids[-1]
    return None
