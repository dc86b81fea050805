"""`hermes`: Hermes 2 Pro / Qwen2.5 style, each call a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; the
text before the first one is content, text between and after them is dropped.
A call without its end tag counts when its JSON is complete (the end tag may be
a stop string), as in vLLM."""
from __future__ import annotations

from typing import Any, Callable

from frontend.tool_parsers.tool_call_scan import CallScanner
from frontend.tool_parsers.tool_parser_base import CallReader, ToolParser, partial_marker


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    keeps_special_tokens = True  # <tool_call> is a special token in some models (vLLM keeps them too)

    def reader(self) -> CallReader:
        return HermesReader(self.new_call_id)


class HermesReader(CallReader):
    START, END = HermesToolParser.START, HermesToolParser.END

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.call: CallScanner | None = None  # the call being written
        self.fed = 0  # how much of the text went to the calls
        self.next_index = 0

    def read(self, text: str, last: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self.error is None:
            if self.call is None:
                start = self._next_call(text, last)
                if start < 0:
                    break
                self.fed = start + len(self.START)
                self.call = CallScanner(depth=0, arguments_keys=("arguments",), first_index=self.next_index,
                                        new_id=self.new_id)
            # A call's JSON ends at its end tag (as the non-stream reply reads it); an
            # end of text that could begin the tag waits for the next piece.
            end = text.find(self.END, self.fed)
            limit = end if end >= 0 else len(text) - (0 if last else partial_marker(text, self.END))
            limit = max(limit, self.fed)
            deltas += self.call.feed(text[self.fed:limit])
            self.fed = limit
            if self.call.error is not None or ((end >= 0 or last) and not self.call.done):
                self.error = self.call.error or "a tool call that is not complete JSON"
            elif end < 0:
                break
            else:
                self.fed, self.call = end + len(self.END), None
                self.next_index += 1
        return deltas

    def _next_call(self, text: str, last: bool) -> int:
        """Where the next call's start tag is (-1: not there yet); the text before the
        first one is content."""
        if self.next_index > 0:
            return text.find(self.START, self.fed)
        start = text.find(self.START, self.content_end)
        self.release_until(text, start, last, self.START)
        return start
