"""The request body of OpenAI's Responses API (POST /v1/responses), and how it
becomes a chat completion: `instructions` a system message, `input` (a string
or a list of items) the conversation after the previous response's, `text.format`
the structured output, function `tools` and `tool_choice` as in chat.

What this server does not do (built-in tools such as web search, images and
files, background runs, reasoning) is a 400 naming the field, never ignored;
so are chat completion fields (max_tokens, response_format, n, ...), which the
chat completion made here would not see.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationError

from common.errors import InvalidRequestError
from common.sampling_params import MAX_LOGPROBS
from frontend.api_errors import NotSupportedError
from frontend.openai.request_bodies import ChatCompletionRequest
from frontend.openai.request_body_base import UNIMPLEMENTED_VLLM_FIELDS, TextRequest, check_unimplemented

# Chat completion fields -> the Responses API field that set them (errors name the client's).
PARAMS_OF_CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                         "response_format": "text.format"}
# Responses fields that pass to the chat completion unchanged (vLLM's extras included).
_SAME_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop",
                "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos", "priority", "cache_salt",
                "user")
# Chat completion fields a response spells otherwise. Any other chat field sent here would
# be ignored (the chat completion is built from the Responses fields): it is a 400 instead.
_RESPONSES_SPELLING = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                       "response_format": "text.format", "messages": "input", "functions": "tools",
                       "function_call": "tool_choice", "logprobs": "include and top_logprobs"}
_CHAT_ONLY_FIELDS = sorted(set(ChatCompletionRequest.model_fields) - set(_SAME_FIELDS) - {
    "stream", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "stream_options"})


OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the only `include` served: the output text's logprobs


def speak_responses(error: InvalidRequestError) -> InvalidRequestError:
    """`error` of the chat completion, naming the Responses field the client sent
    (in `param` and in the message: "max_output_tokens must be ...")."""
    error.message = re.sub(r"\bmax_(?:completion_)?tokens\b", "max_output_tokens", error.message)
    error.param = PARAMS_OF_CHAT_FIELDS.get(error.param or "", error.param)
    return error


class ResponsesRequest(TextRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    store: bool = True
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    truncation: str | None = "disabled"
    reasoning: dict[str, Any] | None = None
    background: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = None  # alternatives per output token, with include's OUTPUT_LOGPROBS
    # OpenAI's bound on calls to built-in tools, of which there are none here: no bound applies.
    max_tool_calls: int | None = Field(None, ge=1)
    user: str | None = None

    def check_supported(self) -> None:
        if self.background:
            raise NotSupportedError("background", "background responses")
        if self.truncation not in (None, "disabled"):
            raise NotSupportedError("truncation", f"truncation {self.truncation!r} (only 'disabled')")
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            raise NotSupportedError("reasoning", "reasoning options (this model does not reason)")
        other = [kind for kind in self.include or [] if kind != OUTPUT_LOGPROBS]
        if other:
            raise NotSupportedError("include", f"extra output ({', '.join(map(str, other))})")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}",
                                      param="top_logprobs")
        extra = self.model_extra or {}
        for name in ("prompt", "conversation"):
            if extra.get(name) not in (None, 0):
                raise NotSupportedError(name)
        _check_metadata(self.metadata or {})
        if (self.text or {}).get("verbosity") not in (None, "medium"):  # "medium" is OpenAI's default
            raise NotSupportedError("text.verbosity", "text.verbosity other than 'medium'")
        options = extra.get("stream_options")  # OpenAI's only option changes no text
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_obfuscation"}):
            raise InvalidRequestError("stream_options of a response may only hold include_obfuscation",
                                      param="stream_options")
        for name in _CHAT_ONLY_FIELDS:
            if extra.get(name) is not None:
                hint = f"; use {_RESPONSES_SPELLING[name]}" if name in _RESPONSES_SPELLING else ""
                raise InvalidRequestError(f"{name} is a chat completion field, not one of the Responses "
                                          f"API{hint}", param=name, code="unknown_parameter")
        check_unimplemented(self, UNIMPLEMENTED_VLLM_FIELDS)

    def wants_logprobs(self) -> bool:
        """The output text's logprobs are asked for (as vLLM: only with include's OUTPUT_LOGPROBS)."""
        return OUTPUT_LOGPROBS in (self.include or [])

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (this turn's only: no instructions, no history)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequestError("input must not be empty", param="input")
        messages: list[dict[str, Any]] = []
        for index, item in enumerate(self.input):
            _add_input_item(messages, item, index)
        return messages

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion that answers this request after `history` (the
        previous responses' conversation, without their instructions)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields = {name: getattr(self, name, None) if name in type(self).model_fields else
                  (self.model_extra or {}).get(name) for name in _SAME_FIELDS}
        try:
            return ChatCompletionRequest.model_validate({
                **{name: value for name, value in fields.items() if value is not None},
                "messages": system + history + self.input_messages(),
                "max_completion_tokens": self.max_output_tokens,
                "response_format": self._response_format(),
                "tools": [_chat_tool(tool, index) for index, tool in enumerate(self.tools or [])] or None,
                "tool_choice": _chat_tool_choice(self.tool_choice),
                "parallel_tool_calls": self.parallel_tool_calls,
                "logprobs": self.wants_logprobs(),
                "top_logprobs": (self.top_logprobs or 0) if self.wants_logprobs() else None,
            })
        except ValidationError as e:  # an extra field of the wrong type (top_k: "x")
            error = e.errors()[0]
            field = str(error["loc"][0]) if error["loc"] else None
            raise InvalidRequestError(f"{field}: {error['msg']}" if field else error["msg"],
                                      param=PARAMS_OF_CHAT_FIELDS.get(field, field)) from None

    def _response_format(self) -> dict[str, Any] | None:
        form = (self.text or {}).get("format")
        if form is not None and not isinstance(form, dict):
            raise InvalidRequestError("text.format must be an object", param="text.format")
        if form is None or form.get("type") == "text":
            return None
        if form.get("type") == "json_schema":  # flat here, nested under json_schema in chat
            return {"type": "json_schema", "json_schema": {key: value for key, value in form.items()
                                                           if key != "type"}}
        return form


def _check_metadata(metadata: dict[str, str]) -> None:
    """OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512."""
    if len(metadata) > 16:
        raise InvalidRequestError(f"metadata may hold at most 16 pairs, not {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise InvalidRequestError(f"metadata key {key[:16]!r}... is longer than 64 characters", param="metadata")
        if len(value) > 512:
            raise InvalidRequestError(f"metadata[{key!r}] is longer than 512 characters", param="metadata")


def _add_input_item(messages: list[dict[str, Any]], item: Any, index: int) -> None:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{where} must be an object", param="input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer", param="input")
        # Chat templates know no developer role: it is the system's, as in chat completions.
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _content_text(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
            last["tool_calls"].append(call)  # calls of one reply, in one assistant turn
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": output if isinstance(output, str) else _content_text(output, where)})
    else:
        raise NotSupportedError("input", f"input items of type {kind!r} (only message, function_call and "
                                         f"function_call_output)")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise NotSupportedError("input", f"content parts of type {kind!r} (only input_text and output_text)")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string", param="input")
    return value


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's ({"type", "function": {...}})."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise NotSupportedError("tools", f"tools of type {kind!r} (only function tools)")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice
