"""`mistral`: the calls follow the [TOOL_CALLS] token, in either of the two
formats vLLM reads (it picks by tokenizer version; here each [TOOL_CALLS] says
by what follows it):
- a JSON list [{"name": ..., "arguments": {...}}, ...] (Mistral 7B v0.3,
  Nemo: tokenizers before v11); "arguments" may be left out ({}).
- name[ARGS]{...} (or name{...}), one call per [TOOL_CALLS] (v11 and later).
The text before the first [TOOL_CALLS] is content; text after a call's JSON
and before the next [TOOL_CALLS] is dropped.

[TOOL_CALLS] and [ARGS] are special tokens: the reply is decoded with them
(skip_special_tokens off, as vLLM does). Call ids are 9 letters and digits, as
Mistral's chat templates require of the ids sent back to them.
Unlike vLLM with a v11 tokenizer, which returns a call whose arguments are not
JSON as written, such a reply is text here, as with every other parser.
"""
from __future__ import annotations

import re
import secrets
import string
from typing import Any, Callable

from frontend.tool_parsers.tool_call_scan import ArgumentsScanner, CallScanner
from frontend.tool_parsers.tool_parser_base import CallReader, ToolParser, partial_marker

_ID_CHARACTERS = string.ascii_letters + string.digits
_NAME = re.compile(r"\s*([\w.\-]+)\s*")
_NAME_SO_FAR = re.compile(r"\s*[\w.\-]*\s*")


class MistralToolParser(ToolParser):
    name = "mistral"
    TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))

    def reader(self) -> CallReader:
        return MistralReader(self.new_call_id)


class MistralReader(CallReader):
    TOOL_CALLS, ARGS = MistralToolParser.TOOL_CALLS, MistralToolParser.ARGS

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.started = False  # a [TOOL_CALLS] came: the content is over
        self.scanner: CallScanner | ArgumentsScanner | None = None  # reading from `scan_start`
        self.scan_start = 0
        self.fed = 0  # where the last call read ended: the next one is looked for from there
        self.next_index = 0

    def read(self, text: str, last: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self.error is None:
            if self.scanner is None and not self._next_calls(text, last):
                break
            new, done = self.scan(self.scanner, self.scan_start, text, last)
            deltas += new
            if not done:
                break
            self.fed = self.scan_start + len(self.scanner.json.text)
            self.next_index += len(self.scanner.calls)
            self.scanner = None
        return deltas

    def _next_calls(self, text: str, last: bool) -> bool:
        """Start reading the calls of the next [TOOL_CALLS] (False: not there yet)."""
        marker = text.find(self.TOOL_CALLS, self.fed if self.started else self.content_end)
        if not self.started:
            self.release_until(text, marker, last, self.TOOL_CALLS)
        if marker < 0:
            return False
        self.started = True
        body = marker + len(self.TOOL_CALLS)
        first = len(text) - len(text[body:].lstrip())
        if first == len(text):
            if last:
                self.error = f"nothing after {self.TOOL_CALLS}"
            return False
        if text[first] == "[":
            self.scanner = CallScanner(depth=1, arguments_keys=("arguments",), then_text=True,
                                       first_index=self.next_index, new_id=self.new_id)
            self.scan_start = first
            return True
        return self._named_call(text, body, last)

    def _named_call(self, text: str, body: int, last: bool) -> bool:
        """name[ARGS]{...}: start reading the arguments once the name is complete."""
        region = text[body:]
        ends = [at for at in (region.find(self.ARGS), region.find("{")) if at >= 0]
        if not ends:
            so_far = region[:len(region) - (0 if last else partial_marker(region, self.ARGS))]
            if not _NAME_SO_FAR.fullmatch(so_far) or last:
                self.error = f"no tool call after {self.TOOL_CALLS}"
            return False
        end = min(ends)
        name = _NAME.fullmatch(region[:end])
        if name is None:
            self.error = f"no tool call name after {self.TOOL_CALLS}"
            return False
        self.scanner = ArgumentsScanner(name.group(1), self.next_index, self.new_id)
        self.scan_start = body + end + (len(self.ARGS) if region.startswith(self.ARGS, end) else 0)
        return True
