"""Per-request sampling parameters: plain data that crosses sockets as msgpack."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from common.errors import InvalidRequestError
from common.structured_outputs import StructuredOutputs

_GREEDY_EPS = 1e-5
_UINT64 = 1 << 64
MAX_SAMPLES = 128  # n and best_of
MAX_LOGPROBS = 20  # logprobs, top_logprobs and prompt_logprobs by default (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # |bias|, as OpenAI
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI
MAX_STOP_STRINGS = 256  # each is looked for after every token: the frontend's cost grows with their number
MAX_BAD_WORDS = 128  # each is tokenized twice and checked against the output every step
_INT64_MAX = (1 << 63) - 1  # what the wire format carries


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick tokens for one request (field names follow vLLM's).

    `temperature == 0` means greedy. `max_tokens=None` means "whatever fits in
    max_model_len" and is resolved by the scheduler on admission. The stop
    strings and the detokenization switches are applied where text is made
    (the frontend, or the offline LLM); everything else on the worker.
    """

    n: int = 1  # samples returned
    best_of: int | None = None  # samples generated (>= n); the n with the best cumulative logprob are returned
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # transformers': divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling
    max_tokens: int | None = 16
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many output tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # alternatives per sampled token (0: only the sampled token's logprob)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # a grammar every output must follow
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None: any)
    bad_words: list[str] = []  # text: tokenized where the tokenizer is into bad_words_token_ids
    bad_words_token_ids: list[list[int]] = []  # what the worker bans (see worker.logits_processors)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len

    @classmethod
    def with_defaults(cls, overrides: Mapping[str, Any] | None = None) -> "SamplingParams":
        """The defaults, with `overrides` on top (the model's generation config)."""
        return msgspec.structs.replace(cls(), **(overrides or {}))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_samples(self) -> int:
        """How many sequences are generated (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters sample `index` of this request runs with.

        Each sample gets its own seed stream (seed + index, as vLLM); the
        prompt's logprobs come with sample 0 only; when best_of > n every
        sample reports its sampled tokens' logprobs, which rank them.
        """
        if self.num_samples == 1:
            return self
        changes: dict = {"n": 1, "best_of": None}
        if self.seed is not None:
            seed = self.seed + index
            changes["seed"] = seed - _UINT64 if seed >= _UINT64 else seed
        if index > 0:
            changes["prompt_logprobs"] = None
        if self.num_samples > self.n and self.logprobs is None:
            changes["logprobs"] = 0
        return msgspec.structs.replace(self, **changes)

    def validate(self, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> "SamplingParams":
        """Raise InvalidRequestError naming the offending parameter; return self.

        With `vocab_size`, token ids (stop_token_ids, logit_bias keys) must
        also lie in the vocabulary. `max_logprobs` (the server's --max-logprobs;
        -1: no bound but the vocabulary) bounds logprobs and prompt_logprobs.
        """
        _check_int("n", self.n, 1, MAX_SAMPLES)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1, MAX_SAMPLES)
            if self.best_of < self.n:
                raise _bad("best_of", f"best_of ({self.best_of}) must be >= n ({self.n})")
        _check_float("temperature", self.temperature, 0.0, 100.0)
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1
                or self.top_k >= 2**31):  # the sampler keeps top_k in int32/int64 tensors
            raise _bad("top_k", f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise _bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(1 << 63), _UINT64 - 1)
        _check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf)
        if self.repetition_penalty == 0.0:
            raise _bad("repetition_penalty", "repetition_penalty must be > 0 (1 disables it)")
        for token_id, bias in self.logit_bias.items():
            _check_token_id("logit_bias", token_id, vocab_size)
            _check_float("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, _INT64_MAX)
        _check_int("min_tokens", self.min_tokens, 0, _INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for token_id in self.stop_token_ids:
            _check_token_id("stop_token_ids", token_id, vocab_size)
        if any(not isinstance(s, str) for s in self.stop):
            raise _bad("stop", "stop must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        bound = logprobs_bound(vocab_size, max_logprobs)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, bound)
        self._validate_vllm_extras(vocab_size)
        return self

    def _validate_vllm_extras(self, vocab_size: int | None) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise _bad("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
            for token_id in self.allowed_token_ids:
                _check_token_id("allowed_token_ids", token_id, vocab_size)
        if any(not isinstance(word, str) or not word.strip() for word in self.bad_words):
            raise _bad("bad_words", "bad_words must be a list of non-blank strings")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise _bad("bad_words", f"bad_words: at most {MAX_BAD_WORDS} words are allowed, got {len(self.bad_words)}")
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:  # each word in two spellings
            raise _bad("bad_words", f"bad_words: at most {2 * MAX_BAD_WORDS} token sequences are allowed")
        for ids in self.bad_words_token_ids:
            if not ids:
                raise _bad("bad_words", "bad_words: every bad word must be at least one token")
            for token_id in ids:
                _check_token_id("bad_words", token_id, vocab_size)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, _INT64_MAX)
            if self.truncate_prompt_tokens == 0:
                raise _bad("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the model's maximum "
                           "context length) or at least 1, got 0")


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def logprobs_bound(vocab_size: int | None, max_logprobs: int) -> int | None:
    """The most logprobs a request may ask for per token (None: no bound)."""
    return vocab_size if max_logprobs == -1 else max_logprobs


def _check_int(param: str, value, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(param, f"{param} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        limits = f"at least {low}" if high is None else f"between {low} and {high}"
        raise _bad(param, f"{param} must be {limits}, got {value!r}")


def _check_float(param: str, value, low: float, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise _bad(param, f"{param} must be a number, got {value!r}")
    if not low <= value <= high:
        raise _bad(param, f"{param} must be between {low:g} and {high:g}, got {value!r}")


def _check_token_id(param: str, token_id, vocab_size: int | None) -> None:
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        raise _bad(param, f"{param}: token ids must be non-negative integers, got {token_id!r}")
    if vocab_size is not None and token_id >= vocab_size:
        raise _bad(param, f"{param}: token id {token_id} is out of vocabulary (size {vocab_size})")
