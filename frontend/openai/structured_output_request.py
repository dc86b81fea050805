"""The structured-output fields of an HTTP request, as one StructuredOutputs spec.

A request may ask in any of vLLM's and OpenAI's spellings, but only one:
- OpenAI's `response_format`: {"type": "json_object"} or {"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}} ("text" asks for nothing);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
"""
from __future__ import annotations

from typing import Any

from common.errors import InvalidRequestError
from common.structured_outputs import StructuredOutputs

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_outputs_from(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                            guided: dict[str, Any]) -> tuple[StructuredOutputs, str] | None:
    """The spec and the field that asked for it. `guided`: the guided_* fields by name (None when not sent)."""
    specs: dict[str, StructuredOutputs] = {}
    if (spec := _from_response_format(response_format)) is not None:
        specs["response_format"] = spec
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
        specs["structured_outputs"] = StructuredOutputs.of("structured_outputs", **structured_outputs)
    for name, value in guided.items():
        if value is not None:
            specs[name] = StructuredOutputs.of(name, **{GUIDED_FIELDS[name]: value})
    if len(specs) > 1:
        raise InvalidRequestError(f"{' and '.join(specs)} each ask for a structured output: send only one",
                                  param=list(specs)[1])
    return next(((spec, param) for param, spec in specs.items()), None)


def _from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputs | None:
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                  f"got {kind!r}", param="response_format")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise InvalidRequestError("response_format of type json_schema needs json_schema.schema, a JSON schema "
                                  "object", param="response_format")
    return StructuredOutputs.of("response_format", json=json_schema["schema"])
