"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 JSON tool calling. Each call is a JSON
object {"name": ..., "parameters": {...}} ("arguments" too, as vLLM reads it),
the first one after <|python_tag|> or at the first "{", the next ones after
whitespace or a ";". The text before the first call is content; what follows
the last call is dropped.

As vLLM: a "{" that does not begin a call (not JSON, no name, no arguments)
makes the whole reply text. Unlike vLLM, which drops the text before the calls
of a whole reply (and only finds calls at the start of a streamed one), that
text is the reply's content, streamed and whole alike.
"""
from __future__ import annotations

from typing import Any, Callable

from frontend.tool_parsers.tool_call_scan import CallScanner
from frontend.tool_parsers.tool_parser_base import CallReader, ToolParser

_WHITESPACE = " \t\n\r"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"  # a special token: usually not in the text (skip_special_tokens)

    def reader(self) -> CallReader:
        return Llama3JsonReader(self.new_call_id)


class Llama3JsonReader(CallReader):
    TAG = Llama3JsonToolParser.PYTHON_TAG

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.started = False  # the calls have started (after the content)
        self.finished = False  # the calls have ended: the rest of the text is dropped
        self.call: CallScanner | None = None  # the call being written, from `call_start`
        self.call_start = 0
        self.fed = 0  # where the last call read ended: the next one is looked for from there
        self.next_index = 0

    def read(self, text: str, last: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self.error is None and not self.finished:
            if self.call is None:
                start = self._next_call(text, last)
                if start < 0:
                    break
                self.call_start = start
                self.call = CallScanner(depth=0, arguments_keys=("parameters", "arguments"), arguments_required=True,
                                        then_text=True, first_index=self.next_index, new_id=self.new_id)
            new, done = self.scan(self.call, self.call_start, text, last)
            deltas += new
            if not done:
                break
            self.fed = self.call_start + len(self.call.json.text)
            self.call = None
            self.next_index += 1
        return deltas

    def _next_call(self, text: str, last: bool) -> int:
        """Where the next call's "{" is (-1: not there yet, or no more calls)."""
        if not self.started:
            tag, brace = text.find(self.TAG, self.content_end), text.find("{", self.content_end)
            start = min((at for at in (tag, brace) if at >= 0), default=-1)
            self.release_until(text, start, last, self.TAG)
            if start < 0:
                return -1
            self.started = True
            self.fed = start + len(self.TAG) if start == tag else start
        at = _skip_whitespace(text, self.fed)
        if self.next_index > 0 and at < len(text) and text[at] == ";":
            at = _skip_whitespace(text, at + 1)
        if at < len(text) and text[at] == "{":
            return at
        if at < len(text) or last:  # not a call: the calls are over (or, after the tag, never began)
            if self.next_index == 0:
                self.error = f"no tool call after {self.TAG}"
            self.finished = True
        return -1


def _skip_whitespace(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at
