"""Structured outputs (vLLM's `structured_outputs` / `guided_*` fields, OpenAI's
`response_format`): constrain generation to a JSON schema, any JSON object,
a regular expression, one of several strings, or an EBNF grammar.

The spec is plain data that crosses sockets inside SamplingParams. Grammars
are built with xgrammar, which is imported only when a request uses them (it
pulls in torch): `check_grammar` in the frontend (so a bad schema is a 400
before anything runs) and `worker.structured_output` on the worker, which
masks the logits of each constrained row.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

import msgspec

from common.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# xgrammar's messages start with a time stamp, a C++ source location and an assertion.
_XGRAMMAR_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class StructuredOutputs(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """Exactly one field set. `json` is a JSON schema, as JSON text."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), with a `root` rule
    json_object: bool = False

    @classmethod
    def of(cls, param: str, **fields: Any) -> "StructuredOutputs":
        """A spec from a request's fields (a schema may come as an object);
        InvalidRequestError naming `param` unless exactly one is set."""
        chosen = {name: value for name, value in fields.items() if value not in (None, False)}
        unknown = sorted(set(chosen) - set(KINDS))
        if unknown:
            raise InvalidRequestError(f"{param}: unknown field(s) {', '.join(unknown)}; expected one of "
                                      f"{', '.join(KINDS)}", param=param)
        if len(chosen) != 1:
            raise InvalidRequestError(f"{param}: set exactly one of {', '.join(KINDS)}"
                                      f"{' (got ' + ', '.join(sorted(chosen)) + ')' if chosen else ''}", param=param)
        (kind, value), = chosen.items()
        if kind == "json":
            if isinstance(value, dict) or isinstance(value, bool):
                value = json.dumps(value)
            elif not isinstance(value, str):
                raise InvalidRequestError(f"{param}: a JSON schema must be an object or its JSON text", param=param)
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError(f"{param}: choice must be a non-empty list of non-empty strings",
                                          param=param)
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequestError(f"{param}: json_object must be true", param=param)
        elif not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{param}: {kind} must be a non-empty string", param=param)
        return cls(**{kind: value})

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    def describe(self) -> str:
        return f"{self.kind} {getattr(self, self.kind)!r}"[:200]


def build_grammar(spec: StructuredOutputs) -> Any:
    """The xgrammar Grammar for `spec` (tokenizer-independent). Raises
    InvalidRequestError (param "structured_outputs") when it is not valid."""
    import xgrammar

    try:
        if spec.json is not None:
            return xgrammar.Grammar.from_json_schema(spec.json)
        if spec.json_object:  # OpenAI's JSON mode: an object
            return xgrammar.Grammar.from_json_schema('{"type": "object"}')
        if spec.regex is not None:
            return xgrammar.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in spec.choice))
        return xgrammar.Grammar.from_ebnf(spec.grammar or "")
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors with a message
        lines = str(e).strip().splitlines()
        message = _XGRAMMAR_NOISE.sub("", lines[0]) if lines else type(e).__name__
        raise InvalidRequestError(f"invalid {spec.kind} for structured output: {message}",
                                  param="structured_outputs") from None


def check_grammar(spec: StructuredOutputs | None) -> None:
    """Raise InvalidRequestError if `spec` does not make a grammar (None: nothing to check).
    Specs found valid are remembered: clients tend to send the same schema again."""
    if spec is not None:
        _check_encoded(msgspec.msgpack.encode(spec))


@functools.lru_cache(maxsize=256)
def _check_encoded(encoded: bytes) -> None:
    build_grammar(msgspec.msgpack.decode(encoded, type=StructuredOutputs))


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") \
        .replace("\t", "\\t")
    return f'"{escaped}"'
