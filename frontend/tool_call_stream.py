"""A chat stream's tool calls, sent as they are generated, as vLLM streams them:
a call's first delta holds its index, id, type and name (with whatever of its
arguments is known), the next ones `{"index": i, "function": {"arguments": ...}}`
with the next piece of the arguments' JSON text.

- a named function: the reply is the arguments; the header goes out at once.
- "required": the reply is a JSON array of {"name", "parameters"} objects.
- "auto" (hermes): text streams as content up to a <tool_call>; each
  <tool_call>{"name", "arguments"}</tool_call> streams as a call; text between
  and after the calls is dropped, as the non-stream reply drops it.

Until a call's header is out, the reply may still turn out to be text (broken
JSON, a call without a name, cut by max_tokens): then the text not yet sent goes
out as content, as the non-stream reply would return it. Once a header is out
it cannot be taken back (vLLM neither): if the calls break after that, what was
streamed stands, the rest is dropped, and the finish reason is the sample's
("length" for a call cut by max_tokens) instead of "tool_calls". When the reply
is whole and valid, the finish reason is the non-stream reply's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.tool_call_scan import CallScanner
from frontend.tool_calls import ToolChoice, new_tool_call_id, tool_call_reply
from frontend.tool_parsers import HermesToolParser, partial_marker


@dataclass(slots=True)
class StreamStep:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


class ToolCallStream:
    """One choice's reply; `feed` each piece of text, `finish` with the last."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.text = ""
        self.sent = 0  # how much of `text` went out as content
        self.committed = False  # a call's header went out: the reply is calls
        self.broken = False  # the text is not (or stopped being) calls

    def feed(self, text: str) -> StreamStep:
        return self._step(text, last=False)

    def finish(self, text: str, finish_reason: str | None) -> StreamStep:
        step = self._step(text, last=True)
        if not self.committed:
            step.finish_reason = finish_reason
            return step
        whole = tool_call_reply(self.text, finish_reason, self.choice)
        step.finish_reason = whole.finish_reason if whole is not None else finish_reason
        return step

    def _step(self, text: str, last: bool) -> StreamStep:
        self.text += text
        step = StreamStep()
        if not self.broken:
            self._advance(step, last)
        self.committed = self.committed or bool(step.tool_calls)
        if not self.committed and (self.broken or last):
            # Not calls after all, and none went out: the reply is text.
            step.content += self.text[self.sent:]
            self.sent = len(self.text)
        return step

    def _advance(self, step: StreamStep, last: bool) -> None:
        """Add to `step` what the new text makes (setting `broken` when it is not calls)."""
        raise NotImplementedError


class NamedCallStream(ToolCallStream):
    """The whole reply is the arguments of the one call."""

    def __init__(self, choice: ToolChoice):
        super().__init__(choice)
        self.id = new_tool_call_id()
        self.arguments_sent = 0  # how much of `text` went out as arguments

    def _advance(self, step: StreamStep, last: bool) -> None:
        fragment, self.arguments_sent = self.text[self.arguments_sent:], len(self.text)
        if not self.committed:
            step.tool_calls.append({"index": 0, "id": self.id, "type": "function",
                                    "function": {"name": self.choice.name, "arguments": fragment}})
        elif fragment:
            step.tool_calls.append({"index": 0, "function": {"arguments": fragment}})


class RequiredCallStream(ToolCallStream):
    """A JSON array of {"name": ..., "parameters": {...}} objects."""

    def __init__(self, choice: ToolChoice):
        super().__init__(choice)
        self.scanner = CallScanner(depth=1, arguments_key="parameters")

    def _advance(self, step: StreamStep, last: bool) -> None:
        step.tool_calls += self.scanner.feed(self.text[len(self.scanner.json.text):])
        self.broken = self.scanner.error is not None


class HermesCallStream(ToolCallStream):
    """Text, then <tool_call>{"name": ..., "arguments": {...}}</tool_call> ..."""

    def __init__(self, choice: ToolChoice, parser: HermesToolParser):
        super().__init__(choice)
        self.parser = parser
        self.call: CallScanner | None = None  # the call being written
        self.fed = 0  # how much of `text` went to `call`
        self.next_index = 0

    def _advance(self, step: StreamStep, last: bool) -> None:
        while True:
            if self.call is None:
                start = self._next_call(step, last)
                if start < 0:
                    return
                self.fed = start + len(self.parser.START)
                self.call = CallScanner(depth=0, arguments_key="arguments", first_index=self.next_index)
            # A call's JSON ends at its end tag (as the non-stream reply reads it); an
            # end of text that could begin the tag waits for the next piece.
            end = self.text.find(self.parser.END, self.fed)
            limit = end if end >= 0 else len(self.text) - (0 if last else partial_marker(self.text, self.parser.END))
            step.tool_calls += self.call.feed(self.text[self.fed:limit])
            self.fed = limit
            if self.call.error is not None or (end >= 0 and not self.call.done):
                self.broken = True
                return
            if end < 0:
                return
            self.fed, self.call = end + len(self.parser.END), None
            self.next_index += 1

    def _next_call(self, step: StreamStep, last: bool) -> int:
        """Where the next call's start tag is (-1: not there yet). The text before
        the first one streams as content, holding back what could begin the tag."""
        if self.next_index > 0:
            return self.text.find(self.parser.START, self.fed)
        start = self.text.find(self.parser.START, self.sent)
        release = start
        if start < 0:
            release = len(self.text) - (0 if last else partial_marker(self.text, self.parser.START))
        step.content += self.text[self.sent:release]
        self.sent = release
        return start


def tool_call_stream(choice: ToolChoice) -> ToolCallStream | None:
    """The stream of a choice's tool calls (None: the reply is plain text)."""
    if choice.mode == "named":
        return NamedCallStream(choice)
    if choice.mode == "required":
        return RequiredCallStream(choice)
    if choice.mode == "auto" and choice.parser is not None:
        return HermesCallStream(choice, choice.parser)
    return None
