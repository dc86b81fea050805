"""A chat stream's tool calls, sent as they are generated, as vLLM streams them:
a call's first delta holds its index, id, type and name (with whatever of its
arguments is known), the next ones `{"index": i, "function": {"arguments": ...}}`
with the next piece of the arguments' JSON text.

- a named function: the reply is the arguments; the header goes out at once.
- "required": the reply is a JSON array of {"name", "parameters"} objects.
- "auto": the parser's reader (`tool_parser_base.CallReader`) finds the calls in
  the text as it grows; the text before the first one streams as content (less
  what could begin a call's marker), text after the calls is dropped, as the
  non-stream reply, which reads the text with the same reader, drops it.

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

from frontend.openai.tool_calls import ToolChoice, tool_call_reply
from frontend.tool_parsers.tool_call_ids import new_tool_call_id
from frontend.tool_parsers.tool_call_scan import CallScanner


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
        self.scanner = CallScanner(depth=1, arguments_keys=("parameters",))

    def _advance(self, step: StreamStep, last: bool) -> None:
        step.tool_calls += self.scanner.feed(self.text[len(self.scanner.json.text):])
        self.broken = self.scanner.error is not None


class AutoCallStream(ToolCallStream):
    """Free text holding calls in the format of the server's tool-call parser."""

    def __init__(self, choice: ToolChoice):
        super().__init__(choice)
        assert choice.parser is not None
        self.reader = choice.parser.reader()

    def _advance(self, step: StreamStep, last: bool) -> None:
        calls = self.reader.read(self.text, last)
        # parallel_tool_calls false: the calls after the first are dropped, as in the non-stream reply.
        step.tool_calls += [call for call in calls if call["index"] == 0] if self.choice.single_call else calls
        step.content += self.text[self.sent:self.reader.content_end]
        self.sent = max(self.sent, self.reader.content_end)
        self.broken = self.reader.error is not None


def tool_call_stream(choice: ToolChoice) -> ToolCallStream | None:
    """The stream of a choice's tool calls (None: the reply is plain text)."""
    if choice.mode == "named":
        return NamedCallStream(choice)
    if choice.mode == "required":
        return RequiredCallStream(choice)
    if choice.mode == "auto" and choice.parser is not None:
        return AutoCallStream(choice)
    return None
