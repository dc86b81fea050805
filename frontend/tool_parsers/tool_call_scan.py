"""Tool calls written as JSON objects, {"name": ..., ARGUMENTS: {...}}, found
while the text is still growing, and turned into OpenAI stream deltas: a
call's header (index, id, type, name) once its name is complete, then its
arguments as the model writes them.

The arguments go out as the model's own text of them (the fragments join
into a JSON text equal, as JSON, to the arguments; the non-stream reply
re-serialises them with `json.dumps`, so the two texts differ only where the
model spaces or escapes differently).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from frontend.tool_parsers.json_scan import JsonEvent, JsonScanner
from frontend.tool_parsers.tool_call_ids import new_tool_call_id


@dataclass(slots=True)
class _Call:
    index: int
    id: str
    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None
    complete: bool = False  # the call's object is closed
    header_sent: bool = False
    arguments_sent: int = 0  # characters of the arguments text sent

    def arguments(self, text: str) -> str:
        """The arguments text known so far: a container's grows as it is written, a
        scalar's (not expected, but valid) is only known whole."""
        if self.arguments_start is None:
            return "{}" if self.complete else ""  # no arguments: {} as the non-stream reply
        if self.arguments_end is not None:
            return text[self.arguments_start:self.arguments_end]
        return text[self.arguments_start:] if text[self.arguments_start] in "{[" else ""

    def delta(self, text: str) -> dict[str, Any] | None:
        """What goes out about this call now (None: nothing new)."""
        if self.name is None:
            return None  # no header without the name
        arguments = self.arguments(text)
        fragment, self.arguments_sent = arguments[self.arguments_sent:], len(arguments)
        if not self.header_sent:
            self.header_sent = True
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": fragment}}
        return {"index": self.index, "function": {"arguments": fragment}} if fragment else None


class CallScanner:
    """The calls in one JSON value: the value itself (depth 0, one call) or the
    objects of a top-level array (depth 1). `arguments_keys`: the keys that may hold
    a call's arguments (the first one written counts); `arguments_required`: a call
    without them is an error (else its arguments are {}), and its header waits for
    them. `then_text`: other text follows the value (see `JsonScanner`)."""

    def __init__(self, depth: int, arguments_keys: tuple[str, ...], first_index: int = 0,
                 arguments_required: bool = False, then_text: bool = False,
                 new_id: Callable[[], str] = new_tool_call_id):
        self.depth, self.arguments_keys, self.first_index = depth, arguments_keys, first_index
        self.arguments_required, self.new_id = arguments_required, new_id
        self.json = JsonScanner(then_text=then_text)
        self.calls: list[_Call] = []
        self.error: str | None = None  # the text is not (or stopped being) calls

    @property
    def done(self) -> bool:
        return self.json.done and self.error is None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Scan more text; the `tool_calls` delta entries it makes (one per call at most)."""
        for event in self.json.feed(text):
            if self.error is None:
                self.error = self._on(event)
        if self.json.error is not None and self.error is None:
            self.error = str(self.json.error)
        return [delta for call in self.calls
                if (self._header_due(call) and (delta := call.delta(self.json.text)) is not None)]

    def _header_due(self, call: _Call) -> bool:
        # With required arguments, a name alone (`{"name": "Bob"}` in prose) is not a call yet.
        return not self.arguments_required or call.arguments_start is not None or call.complete

    def _on(self, event: JsonEvent) -> str | None:
        """Follow one event; what is wrong with it, if anything."""
        text = self.json.text
        if event.depth < self.depth:
            return "tool calls must be a JSON array" if event.kind == "start" and text[event.start] != "[" else None
        if event.depth == self.depth and event.kind == "start":
            if text[event.start] != "{":
                return "a tool call must be a JSON object"
            self.calls.append(_Call(self.first_index + len(self.calls), self.new_id()))
            return None
        call = self.calls[-1]
        if event.depth == self.depth:
            if call.name is None:
                return "a tool call without a name"
            if self.arguments_required and call.arguments_start is None:
                return "a tool call without arguments"
            call.complete = True
        elif event.depth == self.depth + 1 and event.kind == "end" and event.key == "name" and call.name is None:
            name = json.loads(text[event.start:event.end])
            if not isinstance(name, str):
                return "a tool call's name must be a string"
            call.name = name
        elif event.depth == self.depth + 1 and event.key in self.arguments_keys and call.arguments_end is None:
            if event.kind == "start":
                call.arguments_start = event.start
            else:
                call.arguments_end = event.end
        return None


class ArgumentsScanner:
    """One call whose name is already known, its arguments the JSON object that
    comes next (Mistral's `name[ARGS]{...}`), other text possibly after it. The
    header goes out when the object starts."""

    def __init__(self, name: str, index: int, new_id: Callable[[], str]):
        self.name = name
        self.json = JsonScanner(then_text=True)
        self.call = _Call(index, new_id())
        self.calls = [self.call]
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.json.done and self.error is None

    def feed(self, text: str) -> list[dict[str, Any]]:
        for event in self.json.feed(text):
            if event.depth > 0 or self.error is not None:
                continue
            if event.kind == "end":
                self.call.arguments_end, self.call.complete = event.end, True
            elif self.json.text[event.start] == "{":
                self.call.name, self.call.arguments_start = self.name, event.start
            else:
                self.error = "a tool call's arguments must be a JSON object"
        if self.json.error is not None and self.error is None:
            self.error = str(self.json.error)
        delta = self.call.delta(self.json.text)
        return [delta] if delta is not None else []
