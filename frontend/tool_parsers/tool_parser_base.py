"""What a tool-call parser (`--tool-call-parser NAME`) provides, for tool_choice
"auto": the model writes its calls inside free text, in its own format.

A parser reads a reply with a `CallReader`, fed the text as it grows: the text
before the first call is content (streamed as it comes), each call becomes
OpenAI stream deltas (its header, index, id, type and name, once the name is
complete; then pieces of its arguments' JSON text). The non-stream reply reads
the whole text with the same reader, so a streamed reply and a whole one find
the same calls.

Common rules (hermes, llama3_json, mistral, pythonic; vLLM's where it has one):
- text after the calls is dropped, as the content is the text before them;
- a reply whose calls are not all well formed, or that ends inside one (cut
  by max_tokens), is not calls: the whole reply is text (`error` is set).
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from frontend.tool_parsers.tool_call_ids import new_tool_call_id
from frontend.tool_parsers.tool_call_scan import ArgumentsScanner, CallScanner


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker` (to hold
    it back until the next piece tells)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


class CallReader(ABC):
    """One reply's calls, read as its text grows. `read` gets the whole text so far
    (each time the last text and more) and returns the new `tool_calls` delta entries."""

    def __init__(self, new_id: Callable[[], str]):
        self.new_id = new_id  # the id of each call found
        self.content_end = 0  # the text before this is content; it stops growing where the calls start
        self.error: str | None = None  # the text is not (or stopped being) calls; not read again

    @abstractmethod
    def read(self, text: str, last: bool) -> list[dict[str, Any]]:
        """`last`: the text is whole (no marker may be held back; a call not
        complete by now is an error)."""

    def scan(self, scanner: CallScanner | ArgumentsScanner, start: int, text: str,
             last: bool) -> tuple[list[dict[str, Any]], bool]:
        """Feed a call scanner (`tool_call_scan`, reading the text from `start`, other text
        after its value) what it has not seen: (its deltas, whether its value is complete).
        A value that is not calls, or not complete at the end, is an `error`."""
        deltas = scanner.feed(text[start + len(scanner.json.text):])
        if scanner.error is not None or (last and not scanner.done):
            self.error = scanner.error or "a tool call that is not complete JSON"
        return deltas, scanner.done and self.error is None

    def release_until(self, text: str, start: int, last: bool, *markers: str) -> None:
        """Content runs up to `start` (where the calls start), or, when -1, to the end
        of `text` less what could begin one of the `markers`."""
        if start < 0 and not last:
            start = len(text) - max((partial_marker(text, marker) for marker in markers), default=0)
        self.content_end = max(self.content_end, len(text) if start < 0 else start)


class ToolParser(ABC):
    """A format of tool calls in free text. Stateless: one reader per reply."""

    name: str
    # The format's markers are special tokens (vLLM's hermes and mistral): decode the reply
    # with them (skip_special_tokens off), or the parser would never see them.
    keeps_special_tokens = False

    def new_call_id(self) -> str:
        return new_tool_call_id()

    @abstractmethod
    def reader(self) -> CallReader:
        ...

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(the content before the calls, the calls) of a whole reply; ([text], [])
        when it holds none, or calls that are not all well formed (as vLLM)."""
        reader = self.reader()
        deltas = reader.read(text, last=True)
        if reader.error is not None or not deltas:
            return text, []
        calls: dict[int, list[str]] = {}
        for delta in deltas:
            name_and_arguments = calls.setdefault(delta["index"], [delta["function"].get("name", ""), ""])
            name_and_arguments[1] += delta["function"]["arguments"]
        content = text[:reader.content_end]
        # The arguments as vLLM returns them: the model's JSON, re-serialised.
        parsed = [ParsedCall(name, json.dumps(json.loads(arguments), ensure_ascii=False))
                  for name, arguments in (calls[index] for index in sorted(calls))]
        return (content if content.strip() else None), parsed
