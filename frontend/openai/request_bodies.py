"""Request bodies of the OpenAI API (pydantic), with vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, prompt_logprobs, ...). Response bodies are in
`frontend.openai.response_bodies`.

Unknown fields are accepted (clients send vendor fields freely). Types are
checked by pydantic (a 400 naming the field, see api_server), values by
`SamplingParams.validate` (a 400 naming the parameter as the client spelled
it). Fields this server does not implement (tools, suffix, vLLM's
structural tags and other extras) are rejected with a 400
naming them as soon as they ask for something other than the default, never
silently ignored.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from pydantic import Field, PrivateAttr

from common.errors import InvalidRequestError
from common.sampling_params import MAX_LOGPROBS, SamplingParams
from common.structured_outputs import StructuredOutputs
from common.tokenizer import _RESERVED_TEMPLATE_KWARGS as RESERVED_TEMPLATE_KWARGS
from frontend.api_errors import NotSupportedError
from frontend.openai.response_bodies import ModelCard, ModelList, OpenAIBaseModel  # noqa: F401 (api_server's imports)
from frontend.openai.request_body_base import UNIMPLEMENTED_VLLM_FIELDS, RequestBody, TextRequest, check_unimplemented
from frontend.openai.structured_output_request import GUIDED_FIELDS, structured_outputs_from
from frontend.openai.tool_calls import ToolChoice, arguments_as_object, resolve_tool_choice, tool_call_output


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(TextRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the reply
    # vLLM's: n beams, the n best sequences as choices (frontend.engine.beam_search_stream)
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search scores: cumulative logprob / length ** length_penalty
    prompt_logprobs: int | None = None
    echo: bool = False
    priority: int = Field(0, ge=-(1 << 63), lt=1 << 63)  # lower runs first
    cache_salt: str | None = None
    # Structured outputs, in OpenAI's and vLLM's spellings (see frontend.openai.structured_output_request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extras: sampling restricted to / kept from tokens, the prompt's last k tokens, token ids as logprob tokens.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    user: str | None = None  # accepted, not used

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidRequestError("best_of > n cannot be streamed: the best samples are only known at the end",
                                      param="best_of")
        check_unimplemented(self, UNIMPLEMENTED_VLLM_FIELDS)

    def structured_output(self) -> tuple[StructuredOutputs, str] | None:
        """The structured output asked for, and the field that asked (None: free text)."""
        return structured_outputs_from(self.response_format, self.structured_outputs,
                                       {name: getattr(self, name) for name in GUIDED_FIELDS})

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int | None = None,
                           param_names: dict[str, str] | None = None,
                           model_defaults: Mapping[str, Any] | None = None,
                           max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        """Validated engine parameters. `param_names` maps a SamplingParams
        field to the name the client used (e.g. logprobs -> top_logprobs);
        `model_defaults` replace the API's defaults (the model's generation config);
        `max_logprobs` is the engine's --max-logprobs."""
        defaults = SamplingParams.with_defaults(model_defaults)

        def pick(value, default):
            return default if value is None else value

        asked = self.structured_output()
        try:
            params = SamplingParams(
                n=self.n, best_of=self.best_of,
                temperature=pick(self.temperature, defaults.temperature), top_p=pick(self.top_p, defaults.top_p),
                top_k=pick(self.top_k, defaults.top_k), min_p=pick(self.min_p, defaults.min_p), seed=self.seed,
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
                logit_bias=self._logit_bias(),
                max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                stop_token_ids=list(self.stop_token_ids or []), stop=self.stop_strings(),
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                structured_outputs=asked[0] if asked else None,
                allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words or []),
                truncate_prompt_tokens=self.truncate_prompt_tokens)
            return params.validate(vocab_size, max_logprobs)
        except InvalidRequestError as e:  # name the field the client actually sent
            e.param = (param_names or {}).get(e.param, e.param)
            raise

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                          param="logit_bias") from None
        return bias

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether logprobs name tokens "token_id:{id}": the request's choice, else the server's."""
        return server_default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids

    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage in every chunk too: as vLLM, only together with include_usage."""
        return self.include_usage_chunk() and bool(self.stream_options.continuous_usage_stats)


# --- /v1/completions ---------------------------------------------------------------

class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's and vLLM's default (an unbounded default could run to the end of the context);
    # an explicit null asks for as many as fit.
    max_tokens: int | None = 16
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise NotSupportedError("suffix")

    @property
    def echo_only(self) -> bool:
        """OpenAI's (and vLLM's) echo with max_tokens 0: the prompt and its logprobs
        come back, nothing generated (the engine still runs one step for them)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, vocab_size: int | None = None, model_defaults: Mapping[str, Any] | None = None,
                        max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        params = self.to_sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs, vocab_size,
                                         model_defaults=model_defaults, max_logprobs=max_logprobs)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            # The legacy logprobs of an echoed prompt cover its tokens too.
            params = msgspec.structs.replace(params, prompt_logprobs=self.logprobs)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one choice set per entry."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if any(isinstance(p, list) and not p for p in prompt):
            raise InvalidRequestError("prompt must not contain an empty list of token ids", param="prompt")
        return list(prompt)


# --- /v1/chat/completions ----------------------------------------------------------

class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text_content(self, index: int) -> str | None:
        """Content as one string: text parts joined by newlines (what text-only
        chat templates expect), image parts left out; any other part type is a 400."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") == "image_url":
                continue
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise NotSupportedError(f"messages.{index}.content",
                                        f"content part of type {part.get('type')!r} (only 'text')")
            texts.append(part["text"])
        return "\n".join(texts)

    def num_images(self) -> int:
        return sum(part.get("type") == "image_url" for part in self.content) if isinstance(self.content, list) else 0

    def template_content(self, index: int) -> str | list[dict[str, Any]] | None:
        """What the tokenizer pool gets: text_content, or a message with images its parts as they
        are (text and image_url only), which the pool decodes and renders."""
        if not self.num_images():
            return self.text_content(index)
        self.text_content(index)  # the same 400 for any other part type
        return list(self.content)


class ChatTemplateRequest(RequestBody):
    """Messages and how the chat template renders them (chat completions, /tokenize)."""
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: for templates that cite documents (RAG)
    add_special_tokens: bool | None = False  # the tokenizer's (BOS...) on top of the template's, as vLLM

    def check_template_options(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")
        # The tokenizer pool refuses these too, but its reply cannot name the parameter.
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & (self.chat_template_kwargs or {}).keys()):
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
        check_unimplemented(self, {"chat_template": "a chat template per request (chat_template)"})

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, with the tools (chat completions) and documents for
        templates that show them to the model; the request's own kwargs win, as in vLLM."""
        extra = {"tools": getattr(self, "tools", None), "documents": self.documents}
        return {**{name: value for name, value in extra.items() if value}, **(self.chat_template_kwargs or {})}

    def num_images(self) -> int:
        return sum(message.num_images() for message in self.messages)

    def template_messages(self) -> list[dict[str, Any]]:
        messages = []
        for index, message in enumerate(self.messages):
            entry: dict[str, Any] = {"role": message.role, "content": message.template_content(index)}
            for name in ("name", "tool_calls", "tool_call_id"):
                if getattr(message, name) is not None:
                    entry[name] = getattr(message, name)
            if message.tool_calls:
                entry["tool_calls"] = [arguments_as_object(call) for call in message.tool_calls]
            messages.append(entry)
        return messages


class ChatCompletionRequest(SamplingRequest, ChatTemplateRequest):
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None  # the deprecated spelling of tools
    function_call: Any = None  # ... and of tool_choice
    parallel_tool_calls: bool = True  # false: at most one tool call per reply
    _auto_tool_parser: str | None = PrivateAttr(None)  # the server's --tool-call-parser, if enabled
    _new_turn_role: str = PrivateAttr("assistant")  # the server's --response-role

    def enable_auto_tools(self, parser: str | None) -> None:
        """Let tool_choice "auto" run, with this tool-call parser (None: refuse it)."""
        self._auto_tool_parser = parser

    def use_response_role(self, role: str) -> None:
        """The role of a reply that opens a new turn (--response-role)."""
        self._new_turn_role = role

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise NotSupportedError("functions" if self.functions else "function_call",
                                    "the deprecated function calling (functions, function_call); use tools")
        try:
            self.resolved_tool_choice()
        except NotSupportedError as e:  # "auto" by default: the tools are what the client sent
            e.param = "tool_choice" if self.tool_choice is not None else "tools"
            raise
        self.check_template_options()

    def resolved_tool_choice(self) -> ToolChoice:
        return resolve_tool_choice(self.tools, self.tool_choice, self._auto_tool_parser,
                                   parallel_tool_calls=self.parallel_tool_calls)

    def structured_output(self) -> tuple[StructuredOutputs, str] | None:
        """A tool choice that asks for a call is a structured output too (only one may be asked)."""
        asked = super().structured_output()
        tool_output = tool_call_output(self.tools or [], self.resolved_tool_choice())
        if tool_output is None:
            return asked
        if asked is not None:
            raise InvalidRequestError(f"{asked[1]} and tool_choice each ask for a structured output: send only one",
                                      param=asked[1])
        return tool_output, "tool_choice"

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max tokens, the parameter that set it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def sampling_params(self, vocab_size: int | None = None, model_defaults: Mapping[str, Any] | None = None,
                        max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        max_tokens, max_tokens_param = self.requested_max_tokens()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.to_sampling_params(max_tokens, logprobs, vocab_size,
                                         {"max_tokens": max_tokens_param, "logprobs": "top_logprobs"}, model_defaults,
                                         max_logprobs)
        parser = self.resolved_tool_choice().parser
        if parser is not None and parser.keeps_special_tokens:
            # Its markers are special tokens: skipped, the parser would never see a call (as vLLM).
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        return params

    def response_role(self) -> str:
        """The reply's role, as vLLM's: --response-role (the assistant's) when the template
        opens a new turn, else (a turn being continued) that of the last message."""
        return self._new_turn_role if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self) -> str:
        """vLLM's chat echo: the last message's content, when it has the reply's role."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        return (last.text_content(len(self.messages) - 1) or "") if last.role == self.response_role() else ""
