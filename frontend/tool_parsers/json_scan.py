"""An incremental JSON scanner: fed the text of one JSON value as it is
generated, it checks the syntax (RFC 8259, as `json.loads` without NaN and
Infinity) and reports where each value starts and ends, so a streamed tool
call can be cut into its parts before the whole text is there.

One pass over the text, a character at a time: a reply's text is scanned
once however many pieces it arrives in. By default the text is the value alone
(only whitespace may follow it); `then_text=True` scans a value that other
text follows (tool calls inside free text): scanning stops at its end.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal


class JsonSyntaxError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class JsonEvent:
    kind: Literal["start", "end"]
    depth: int  # 0: the top-level value
    key: str | int | None  # its key in an object, its index in an array, None at the top
    start: int  # offsets in the scanned text
    end: int | None = None  # past its last character; None when it starts


@dataclass(slots=True)
class _Container:
    closer: str  # "}" or "]"
    start: int
    key: str | int | None  # the container's own key in its parent
    member: str | int | None = None  # the key (index) of the value being written in it
    count: int = 0  # values written in it so far


_WHITESPACE = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
# Number states from which the number may end.
_NUMBER_ENDS = {"zero", "int", "frac", "exp"}


class JsonScanner:
    def __init__(self, then_text: bool = False) -> None:
        self.text = ""
        self.done = False  # the top-level value is complete
        self.then_text = then_text  # stop at the value's end: `text` is the value, the rest is not scanned
        self.end: int | None = None  # where the top-level value ends, once it has
        self.error: JsonSyntaxError | None = None  # the text stopped being JSON
        self._stack: list[_Container] = []
        self._state = "value"  # what the next character may be
        self._scalar_start = 0  # where the string, number or literal being read starts
        self._is_key = False  # the string being read is an object key
        self._literal = ""  # the rest of true / false / null
        self._hex_left = 0

    def feed(self, text: str) -> list[JsonEvent]:
        """Scan more text; the values that started or ended in it. At the first
        character that cannot continue a JSON value, `error` is set, `text` ends
        before it (what is valid) and the rest, and any later text, is ignored."""
        events: list[JsonEvent] = []
        if self.error is not None:
            return events
        offset = len(self.text)
        self.text += text
        for position in range(offset, len(self.text)):
            if self.done and self.then_text:
                break
            try:
                self._step(self.text[position], position, events)
            except JsonSyntaxError as e:
                self.error, self.text = e, self.text[:position]
                break
        if self.done and self.then_text:  # what follows is not the value's (a number ends at the next character)
            self.text = self.text[:self.end]
        return events

    # --- where a value starts and ends -------------------------------------------
    def _key(self) -> str | int | None:
        return self._stack[-1].member if self._stack else None

    def _start_value(self, char: str, position: int, events: list[JsonEvent]) -> None:
        if char not in '{["-' and char not in _LITERALS and not (char.isdigit() and char.isascii()):
            raise JsonSyntaxError(f"no JSON value starts with {char!r} at {position}")
        if self._stack and self._stack[-1].closer == "]":
            self._stack[-1].member = self._stack[-1].count
        events.append(JsonEvent("start", len(self._stack), self._key(), position))
        self._scalar_start = position
        if char in "{[":
            self._stack.append(_Container("}" if char == "{" else "]", position, self._key()))
            self._state = "first_key" if char == "{" else "first_value"
        elif char == '"':
            self._is_key, self._state = False, "string"
        elif char == "-":
            self._state = "minus"
        elif char.isdigit() and char.isascii():
            self._state = "zero" if char == "0" else "int"
        else:
            self._literal, self._state = _LITERALS[char][1:], "literal"

    def _end_scalar(self, end: int, events: list[JsonEvent]) -> None:
        self._end_value(self._key(), self._scalar_start, end, events)

    def _close(self, position: int, events: list[JsonEvent]) -> None:
        container = self._stack.pop()
        self._end_value(container.key, container.start, position + 1, events)

    def _end_value(self, key: str | int | None, start: int, end: int, events: list[JsonEvent]) -> None:
        events.append(JsonEvent("end", len(self._stack), key, start, end))
        self._state = "after_value"
        if self._stack:
            self._stack[-1].count += 1
        else:
            self.done, self.end = True, end

    # --- one character -----------------------------------------------------------
    def _step(self, char: str, position: int, events: list[JsonEvent]) -> None:
        state = self._state
        if state in ("string", "escape", "unicode"):
            self._string_step(char, position, events)
        elif state == "literal":
            if char != self._literal[0]:
                raise JsonSyntaxError(f"unexpected {char!r} in a literal at {position}")
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_scalar(position + 1, events)
        elif state in ("minus", "zero", "int", "dot", "frac", "e", "e_sign", "exp"):
            if not self._number_step(char):
                if state not in _NUMBER_ENDS:
                    raise JsonSyntaxError(f"unexpected {char!r} in a number at {position}")
                self._end_scalar(position, events)
                if not (self.done and self.then_text):
                    self._step(char, position, events)  # the character after the number
        elif char in _WHITESPACE:
            pass
        elif state == "value":
            self._start_value(char, position, events)
        elif state == "first_value" and char == "]":
            self._close(position, events)
        elif state == "first_value":
            self._start_value(char, position, events)
        elif state in ("first_key", "key") and char == '"':
            self._scalar_start, self._is_key, self._state = position, True, "string"
        elif state == "first_key" and char == "}":
            self._close(position, events)
        elif state == "colon" and char == ":":
            self._state = "value"
        elif state == "after_value" and self._stack and char == ",":
            self._state = "key" if self._stack[-1].closer == "}" else "value"
        elif state == "after_value" and self._stack and char == self._stack[-1].closer:
            self._close(position, events)
        else:
            raise JsonSyntaxError(f"unexpected {char!r} at {position}")

    def _string_step(self, char: str, position: int, events: list[JsonEvent]) -> None:
        if self._state == "escape":
            if char not in _ESCAPES + "u":
                raise JsonSyntaxError(f"bad escape \\{char} at {position}")
            self._state, self._hex_left = ("unicode", 4) if char == "u" else ("string", 0)
        elif self._state == "unicode":
            if char not in _HEX:
                raise JsonSyntaxError(f"bad \\u escape at {position}")
            self._hex_left -= 1
            self._state = "unicode" if self._hex_left else "string"
        elif char == "\\":
            self._state = "escape"
        elif char < " ":
            raise JsonSyntaxError(f"control character in a string at {position}")
        elif char == '"' and self._is_key:
            self._stack[-1].member = json.loads(self.text[self._scalar_start:position + 1])
            self._state = "colon"
        elif char == '"':
            self._end_scalar(position + 1, events)

    def _number_step(self, char: str) -> bool:
        """Whether `char` continues the number (and the state it leads to)."""
        digit = char.isdigit() and char.isascii()
        state = self._state
        if state == "minus" and digit:
            self._state = "zero" if char == "0" else "int"
        elif state in ("int", "frac", "exp") and digit:
            pass
        elif state in ("zero", "int") and char == ".":
            self._state = "dot"
        elif state == "dot" and digit:
            self._state = "frac"
        elif state in ("zero", "int", "frac") and char in "eE":
            self._state = "e"
        elif state == "e" and char in "+-":
            self._state = "e_sign"
        elif state in ("e", "e_sign") and digit:
            self._state = "exp"
        else:
            return False
        return True
