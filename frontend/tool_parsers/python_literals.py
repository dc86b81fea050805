"""One `key=value` argument of a pythonic tool call, read with `ast` (parsed,
never evaluated) and its value turned into JSON: str, int, finite float, bool,
None, lists and tuples, dicts with string keys, a sign before a number, and the
JSON spellings true / false / null that models also write (as vLLM). Anything
else (names, calls, f-strings with fields, operators) is not a literal."""
from __future__ import annotations

import ast
import math
import warnings
from typing import Any

_JSON_NAMES = {"true": True, "false": False, "null": None}


class NotALiteral(ValueError):
    pass


def keyword_argument(text: str) -> tuple[str, Any]:
    """`text` is what stands between two commas (or a comma and a parenthesis) of a call."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. an invalid escape sequence "\d" in a string
            call = ast.parse(f"f({text})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise NotALiteral(f"not a keyword argument: {text!r}") from e
    if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1 or call.keywords[0].arg is None:
        raise NotALiteral(f"a tool call's arguments are key=value, not {text.strip()!r}")
    return call.keywords[0].arg, json_value(call.keywords[0].value)


def json_value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, int)) or (isinstance(value, float) and math.isfinite(value)):
            return value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [json_value(element) for element in node.elts]
    elif isinstance(node, ast.Dict):
        if all(isinstance(key, ast.Constant) and isinstance(key.value, str) for key in node.keys):
            return {key.value: json_value(value)  # type: ignore[union-attr]
                    for key, value in zip(node.keys, node.values)}
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = json_value(node.operand)
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    raise NotALiteral(f"not a JSON value: {ast.dump(node)[:80]}")
