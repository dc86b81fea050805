"""What every OpenAI request body shares: null means the field's default, text
holds no lone surrogates, and vLLM extras this server does not implement are
refused instead of ignored."""
from __future__ import annotations

import typing
from typing import Any

from pydantic import model_validator

from common.errors import InvalidRequestError
from frontend.api_errors import NotSupportedError
from frontend.openai.response_bodies import OpenAIBaseModel

# vLLM's extra request fields that change what is generated or returned, which this
# server does not implement: asking for anything with them is a 400 (accepted as
# unknown fields, they would be silently ignored). Field -> what it asks for.
UNIMPLEMENTED_VLLM_FIELDS = {
    "structural_tag": "structured output (structural_tag)",
    "guided_whitespace_pattern": "structured output with a whitespace pattern (guided_whitespace_pattern)",
    "logits_processors": "logits_processors",
}


def check_unimplemented(body: OpenAIBaseModel, fields: dict[str, str]) -> None:
    for name, what in fields.items():
        if (body.model_extra or {}).get(name) not in (None, False, [], {}, ""):
            raise NotSupportedError(name, what)


class RequestBody(OpenAIBaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # OpenAI's schema lets clients send null for "not set" (the openai client turns n=None
        # into "n": null): a field that cannot hold None then takes its default.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or _nullable(fields[key].annotation)}


def _nullable(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in typing.get_args(annotation)


class TextRequest(RequestBody):
    """A body whose strings go to the tokenizer."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        # JSON may spell a lone UTF-16 surrogate ("\ud800"): no UTF-8 text has one, so
        # neither the tokenizer nor any message could carry it.
        if (path := _lone_surrogate_path(data)) is not None:
            raise InvalidRequestError(f"{path or 'the body'} holds a lone UTF-16 surrogate, which is not "
                                      f"valid Unicode text", param=path or None)
        return data


def _lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The JSON path ("messages[0].content") of the first string holding a lone
    surrogate, "" for the value itself, None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate_path(key, path) if isinstance(key, str) else None
            if found is None:
                found = _lone_surrogate_path(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, (int, float)):  # token-id lists: nothing to look at
                if (found := _lone_surrogate_path(item, f"{path}[{index}]")) is not None:
                    return found
    return None
