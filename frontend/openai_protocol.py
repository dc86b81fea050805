"""Request and response bodies of the OpenAI API (pydantic), with vLLM's extra
sampling fields (top_k, min_p, min_tokens, ignore_eos, stop_token_ids, ...).

Unknown fields are accepted (clients send vendor fields freely). Fields this
server does not implement yet are rejected with a 400 naming them as soon as
they ask for something other than the default, never silently ignored.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from frontend.errors import NotSupportedError


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        """400 for what the engine cannot do yet (rather than silently ignoring it)."""
        if self.n != 1:
            if self.n < 1:
                raise InvalidRequestError(f"n must be at least 1, got {self.n}", param="n")
            raise NotSupportedError("n", "n > 1 (several choices per prompt)")
        if self.best_of not in (None, 1):
            raise NotSupportedError("best_of", "best_of > 1")
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise NotSupportedError(name)
        if self.logit_bias:
            raise NotSupportedError("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        defaults = SamplingParams()
        params = SamplingParams(
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []))
        return params.validate()

    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# --- /v1/completions ---------------------------------------------------------------

class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise NotSupportedError("logprobs")
        if self.suffix:
            raise NotSupportedError("suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one entry per choice."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details={"cached_tokens": cached_tokens})


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# Stream chunks of /v1/completions reuse CompletionResponse (same object name).

# --- /v1/chat/completions ----------------------------------------------------------

class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text_content(self, index: int) -> str | None:
        """Content as one string: text parts joined by newlines (what text-only
        chat templates expect); any other part type is a 400."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise NotSupportedError(f"messages.{index}.content",
                                        f"content part of type {part.get('type')!r} (only 'text')")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    echo: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise NotSupportedError("echo", "echo for chat completions")
        if self.logprobs or self.top_logprobs:
            raise NotSupportedError("logprobs" if self.logprobs else "top_logprobs")
        if self.tools:
            raise NotSupportedError("tools", "tool calling")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise NotSupportedError("response_format", "structured output (response_format)")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max tokens, the parameter that set it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def template_messages(self) -> list[dict[str, Any]]:
        messages = []
        for index, message in enumerate(self.messages):
            entry: dict[str, Any] = {"role": message.role, "content": message.text_content(index)}
            for name in ("name", "tool_calls", "tool_call_id"):
                if getattr(message, name) is not None:
                    entry[name] = getattr(message, name)
            messages.append(entry)
        return messages


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_fields(self, handler) -> dict[str, Any]:
        # OpenAI deltas hold only what changed: {"content": "x"}, or {} at the end.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# --- /v1/models ---------------------------------------------------------------------

class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
