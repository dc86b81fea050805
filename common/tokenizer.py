"""Loading a model's tokenizer (local files only) and rendering chat prompts."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from common.errors import ConfigError, InvalidRequestError

# Arguments of transformers' apply_chat_template that a request must not
# reach through chat_template_kwargs: they change what we get back, or (for
# chat_template) would let a client run a template of its choosing.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "chat_template",
})


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: the path of a Jinja file, or the template
    itself. A value with none of `{`, `}` or a newline is taken for a path, so a
    mistyped path is an error rather than a template that prints it. Checked to
    parse here, so a broken template fails at startup, not on every request."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the chat template {value}: {exc}") from exc
    elif os.path.isdir(path):
        raise ConfigError(f"the chat template {value} is a directory, not a file")
    elif any(mark in value for mark in "{}\n"):
        template = value
    else:
        raise ConfigError(f"chat template {value!r} looks like a path, but there is no such file")
    if not template.strip():
        raise ConfigError(f"the chat template {value!r} is empty")
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template {value!r} is not valid Jinja: {exc.message} (line {exc.lineno})") \
            from exc
    return template


def load_tokenizer(model_dir: str, chat_template: str | None = None):
    """The fast (Rust-backed) transformers tokenizer in `model_dir`, with
    `chat_template` (the text, see load_chat_template) in place of the
    model's own when given. Never touches the network. With a tokenizer.json
    we load the generic fast class: AutoTokenizer would import torch, which
    costs each tokenizer process ~190 MB and seconds of startup, for the same
    tokenizer.json."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not os.path.isdir(model_dir):
        raise ConfigError(f"tokenizer directory {model_dir} does not exist")
    loader = (PreTrainedTokenizerFast if os.path.exists(os.path.join(model_dir, "tokenizer.json"))
              else AutoTokenizer)
    try:
        tokenizer = loader.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {model_dir}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"the tokenizer in {model_dir} has no fast (tokenizer.json) version")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _tokenizer_file_eos_id(model_dir: str) -> int | None:
    """tokenizer_config.json's eos_token, looked up in tokenizer.json with the
    light `tokenizers` library (no transformers import, e.g. in the scheduler)."""
    eos = _read_json(os.path.join(model_dir, "tokenizer_config.json")).get("eos_token")
    if isinstance(eos, Mapping):
        eos = eos.get("content")
    tokenizer_file = os.path.join(model_dir, "tokenizer.json")
    if not isinstance(eos, str) or not os.path.isfile(tokenizer_file):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_file).token_to_id(eos)


def eos_token_ids(model_dir: str, tokenizer=None) -> list[int]:
    """Every id that ends a generation: generation_config.json's eos_token_id
    (an int or a list; config.json's when there is no generation config),
    then the tokenizer's eos token. Order kept, duplicates dropped."""
    generation = _read_json(os.path.join(model_dir, "generation_config.json"))
    source = generation if "eos_token_id" in generation else _read_json(os.path.join(model_dir, "config.json"))
    ids = _as_id_list(source.get("eos_token_id"))
    tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else _tokenizer_file_eos_id(model_dir)
    ids.extend(_as_id_list(tokenizer_eos))
    return list(dict.fromkeys(ids))


def _content_text(content: Any, index: int) -> str:
    """A message's content as one string: text parts joined with newlines
    (as vLLM does); any non-text part is refused, this server is text-only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"messages[{index}].content must be a string or a list of content parts",
                                  param="messages")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            shown = kind if kind is not None else type(part).__name__
            raise InvalidRequestError(
                f"messages[{index}].content has a part of type {shown!r}; only 'text' parts are supported",
                param="messages")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"messages[{index}].content text part needs a string 'text'", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict]:
    """Validated copies of chat messages with string content."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{index}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{index}].role must be a non-empty string", param="messages")
        normalized.append({**message, "content": _content_text(message.get("content"), index)})
    return normalized


def render_chat_prompt(tokenizer, messages: Any, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       chat_template_kwargs: Mapping[str, Any] | None = None,
                       chat_template: str | None = None) -> str:
    """The prompt text the model's chat template (or `chat_template`) makes of `messages`."""
    from jinja2 import TemplateError

    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use the completions API instead",
                                  param="messages")
    kwargs = dict(chat_template_kwargs or {})
    if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys()):
        raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
    conversation = normalize_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                  param="continue_final_message")
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template, **kwargs)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise InvalidRequestError(f"cannot apply the chat template to these messages: {exc}",
                                  param="messages") from exc


def apply_chat_template(tokenizer, messages: Any, add_generation_prompt: bool = True,
                        continue_final_message: bool = False,
                        chat_template_kwargs: Mapping[str, Any] | None = None,
                        chat_template: str | None = None) -> list[int]:
    """Prompt token ids for a chat. The template writes any BOS itself, so
    the tokenizer adds no special tokens (as transformers does)."""
    prompt = render_chat_prompt(tokenizer, messages, add_generation_prompt, continue_final_message,
                                chat_template_kwargs, chat_template)
    return list(tokenizer.encode(prompt, add_special_tokens=False))
