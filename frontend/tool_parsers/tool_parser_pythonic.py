"""`pythonic`: Llama 3.2 / Llama 4 style, the reply is a Python list of calls,
[get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")], with
keyword arguments whose values are literals (`python_literals`, read with `ast`,
never evaluated), turned into JSON.

As vLLM: the calls are the reply, starting with its "[" (Llama 4's
<|python_start|> before it is allowed); a reply starting otherwise is text, and so
is one whose list is not all well-formed calls. Unlike vLLM, text after the "]"
is dropped (vLLM returns such a reply as text).

Streamed argument by argument: each argument goes out once its value is complete
(at the "," or ")" after it) as a piece of the arguments' JSON text,
`{"city": "Paris"`, then `, "unit": "celsius"}` at the ")"; the call's header comes
with its first piece, so a call whose first argument is not a literal never
went out. (vLLM sends the name sooner, and pieces of a value before it is
complete; a value here goes out whole.)
"""
from __future__ import annotations

import json
from typing import Any, Callable

from frontend.tool_parsers.python_literals import NotALiteral, keyword_argument
from frontend.tool_parsers.tool_parser_base import CallReader, ToolParser

_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def reader(self) -> CallReader:
        return PythonicReader(self.new_call_id)


class PythonicReader(CallReader):
    PYTHON_START = "<|python_start|>"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.state = "begin"  # begin, list, name, paren, argument, after_call, done, text
        self.at = 0  # the next character to read
        self.mark = 0  # where the name or argument being read starts
        self.name = ""  # the call's, once complete
        self.nesting: list[str] = []  # brackets open in the argument
        self.quote = ""  # the quote of the string being read ('', ', ", ''' or """)
        self.index = -1  # the call being read
        self.keys: set[str] = set()  # its arguments so far
        self.deltas: list[dict[str, Any]] = []

    def read(self, text: str, last: bool) -> list[dict[str, Any]]:
        self.deltas = []
        while self.error is None and self.at < len(text) and self.state not in ("done", "text"):
            if not self._step(text, last):
                break  # the next characters decide
        if self.state == "text" or (self.state == "begin" and last):
            self.state, self.content_end = "text", len(text)
        elif last and self.error is None and self.state != "done":
            self.error = "the list of tool calls is not complete"
        return _merged(self.deltas)

    def _step(self, text: str, last: bool) -> bool:
        """Read the character at `at` (and maybe more); False: wait for more text."""
        char, state = text[self.at], self.state
        if state in ("argument", "string"):
            return self._argument_step(text, last)
        if char.isspace() and state != "name":
            self.at += 1
        elif state == "begin":
            if text.startswith(self.PYTHON_START, self.at):
                self.at += len(self.PYTHON_START)
            elif self.PYTHON_START.startswith(text[self.at:]) and not last:
                return False
            else:
                self.state = "list" if char == "[" else "text"
                self.at += 1
        elif state == "list" and char == "]":  # an empty list, or a comma before the "]"
            self.state, self.at = "done", self.at + 1
        elif state == "list" and char.isidentifier():
            self.state, self.mark = "name", self.at
        elif state == "name" and (("a" + char).isidentifier() or char == "."):
            self.at += 1
        elif state == "name":
            self.state, self.name = "paren", text[self.mark:self.at]
        elif state == "paren" and char == "(":
            self._start_call()
            self.state, self.mark, self.at = "argument", self.at + 1, self.at + 1
        elif state == "after_call" and char in ",]":
            self.state, self.at = ("list" if char == "," else "done"), self.at + 1
        else:
            self.error = f"not a list of tool calls: {char!r} at {self.at}"
        return True

    def _argument_step(self, text: str, last: bool) -> bool:
        char = text[self.at]
        if self.state == "string":
            if char == "\\":
                if self.at + 1 == len(text) and not last:
                    return False
                self.at += 2  # the escaped character cannot end the string
            elif text.startswith(self.quote, self.at):
                self.state, self.at = "argument", self.at + len(self.quote)
            elif len(self.quote) == 3 and self.quote.startswith(text[self.at:]) and not last:
                return False  # perhaps the end of a triple-quoted string
            elif char == "\n" and len(self.quote) == 1:
                self.error = "a line break in a string"
            else:
                self.at += 1
        elif char in "'\"":
            ahead = text[self.at:self.at + 3]
            if len(ahead) < 3 and ahead == char * len(ahead) and not last:
                return False  # one quote, or three?
            self.quote = char * 3 if text.startswith(char * 3, self.at) else char
            self.state, self.at = "string", self.at + len(self.quote)
        elif char in _CLOSERS:
            self.nesting.append(_CLOSERS[char])
            self.at += 1
        elif self.nesting and char == self.nesting[-1]:
            self.nesting.pop()
            self.at += 1
        elif not self.nesting and char in ",)":
            self._argument(text[self.mark:self.at], closing=char == ")")
            self.mark = self.at = self.at + 1
        elif char in ")]}#":
            self.error = f"unexpected {char!r} in a tool call's arguments at {self.at}"
        else:
            self.at += 1
        return True

    def _start_call(self) -> None:
        if not all(part.isidentifier() for part in self.name.split(".")):
            self.error = f"not a function name: {self.name!r}"
            return
        self.index += 1
        self.keys = set()

    def _argument(self, text: str, closing: bool) -> None:
        """One argument is complete: its piece of the arguments' JSON (and the end, at ")")."""
        piece = ""
        if text.strip():
            try:
                key, value = keyword_argument(text)
                piece = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            except (NotALiteral, ValueError) as e:  # ValueError: an int too long to print
                self.error = str(e)
                return
            if key in self.keys:
                self.error = f"the argument {key!r} is given twice"
                return
            piece = (", " if self.keys else "{") + piece
            self.keys.add(key)
        elif not closing:
            self.error = "an empty argument"
            return
        if closing:
            piece += "}" if self.keys else "{}"
            self.state = "after_call"
        if piece.startswith("{"):  # the call's first piece: its header too
            self.deltas.append({"index": self.index, "id": self.new_id(), "type": "function",
                                "function": {"name": self.name, "arguments": piece}})
        else:
            self.deltas.append({"index": self.index, "function": {"arguments": piece}})


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call: a piece of text may complete several of a call's arguments."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"]:
            merged[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            merged.append(delta)
    return merged
