"""Reading the tool calls of a chat stream as a client does: each call's first
delta (and only it) carries its id, type and name; the arguments are the
concatenation of its deltas' `function.arguments`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamedCall:
    index: int
    id: str
    type: str
    name: str
    fragments: list[str] = field(default_factory=list)  # the non-empty argument pieces, in order

    @property
    def arguments(self) -> str:
        return "".join(self.fragments)


def streamed_calls(chunks, choice: int = 0) -> list[StreamedCall]:
    """One choice's calls, in index order (checking the indices run 0, 1, ...)."""
    calls: dict[int, StreamedCall] = {}
    for chunk in chunks:
        for streamed in chunk.choices:
            if streamed.index != choice:
                continue
            for delta in streamed.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name, delta
                    calls[delta.index] = StreamedCall(delta.index, delta.id, delta.type, delta.function.name)
                else:
                    assert delta.id is None and delta.type is None and delta.function.name is None, delta
                if delta.function.arguments:
                    calls[delta.index].fragments.append(delta.function.arguments)
    assert sorted(calls) == list(range(len(calls)))
    return [calls[index] for index in sorted(calls)]


def streamed_content(chunks, choice: int = 0) -> str:
    return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == choice)


def finish_reason(chunks, choice: int = 0) -> str | None:
    [reason] = [c.finish_reason for chunk in chunks for c in chunk.choices if c.index == choice and c.finish_reason]
    return reason
