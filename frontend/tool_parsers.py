"""Tool-call parsers for `tool_choice: "auto"` (`--enable-auto-tool-choice
--tool-call-parser NAME`, as vLLM): the model writes tool calls in its own
format inside free text, and the parser finds them.

`hermes`: Hermes 2 Pro / Qwen2.5 style, each call a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(the content before the calls, the calls). A reply whose calls are not
        all valid JSON stays text, as in vLLM: ([text], [])."""
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
            except (ValueError, KeyError, TypeError):
                return text, []
            if not isinstance(name, str):
                return text, []
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
        content = text[:start]  # as streamed (and as vLLM returns it)
        return (content if content.strip() else None), calls


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker` (to hold
    it back until the next piece tells)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}
