"""Response bodies of the OpenAI API (pydantic), field for field as OpenAI's,
with vLLM's additions (stop_reason, prompt_logprobs, and with `return_token_ids`
the prompt's and each choice's token ids)."""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class TokenIdsOnRequest(OpenAIBaseModel):
    """A body whose token-id fields (vLLM's `return_token_ids`) appear only when asked for."""
    _token_id_fields: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "token_ids")

    @model_serializer(mode="wrap")
    def _omit_token_ids_not_asked_for(self, handler) -> dict[str, Any]:
        dumped = handler(self)
        for name in self._token_id_fields:
            if dumped.get(name, 0) is None:
                del dumped[name]
        return dumped


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


# vLLM's prompt_logprobs: per prompt token, None for the first, else
# {token id: {"logprob", "rank", "decoded_token"}} for the actual token and the top-k.
PromptLogprobsJSON = list[dict[str, dict[str, Any]] | None]

# --- /v1/completions ---------------------------------------------------------------


class CompletionLogprobs(OpenAIBaseModel):
    """The legacy logprobs object: parallel lists, one entry per token."""
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(TokenIdsOnRequest):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None
    prompt_token_ids: list[int] | None = None  # its prompt's (a stream: in the choice's first chunk)
    token_ids: list[int] | None = None  # the tokens of `text` (echo aside)


class CompletionResponse(OpenAIBaseModel):
    """Also each stream chunk of /v1/completions (same object name)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions ----------------------------------------------------------


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(TokenIdsOnRequest):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # every output token of the choice (tool calls included)


class ChatCompletionResponse(TokenIdsOnRequest):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJSON | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # entries with an `index`; a call's first has id, type, name

    @model_serializer(mode="wrap")
    def _omit_unset_fields(self, handler) -> dict[str, Any]:
        # OpenAI deltas hold only what changed: {"content": "x"}, or {} at the end.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(TokenIdsOnRequest):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # the output tokens since the choice's previous chunk


class ChatCompletionChunk(TokenIdsOnRequest):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None
    prompt_token_ids: list[int] | None = None  # in the first chunk


# --- /v1/models ---------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
