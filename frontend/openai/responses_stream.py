"""A response streamed as the Responses API's events, as it is generated:
response.created and .in_progress, then each output item in turn (added, its
deltas, done) and response.completed (.incomplete when max_output_tokens cut
it).

Text goes out as output_text deltas of a message item. A reply that may call
functions goes through the chat stream's `ToolCallStream`: the text before
the calls streams as the message, then each call is a function_call item
whose arguments' JSON text follows in response.function_call_arguments.delta
events, piece by piece as the model writes it, as OpenAI streams them. What
went out is the final response (what `ToolCallStream` sends adds up to the
non-stream reply, or stands once a call went out). Asked for, logprobs go out
with the message's text deltas, tools or not.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

from common.protocol import TokenLogprobs
from frontend.engine.generation import GenerationDelta
from frontend.openai.responses_draft import ResponseDraft
from frontend.openai.responses_items import call_id_of, function_call_item, message_item, new_item_id, text_part
from frontend.openai.tool_call_stream import StreamStep, ToolCallStream


async def response_events(draft: ResponseDraft, reply: Any, deltas: AsyncIterator[GenerationDelta],
                          calls: ToolCallStream | None) -> AsyncIterator[str]:
    """`calls` None: the reply is text (tool_choice "none", or no tools)."""
    for line in draft.opening():
        yield line
    output = _Output(draft)
    finish_reason = None
    held: list[TokenLogprobs] = []  # logprobs of tokens whose text has not gone out yet
    async with aclosing(deltas):
        async for delta in deltas:
            reply.last = delta
            logprobs = None
            held += delta.logprobs or []
            if calls is None:
                step = StreamStep(content=delta.text, finish_reason=delta.finish_reason)
            else:
                step = calls.feed(delta.text) if delta.finish_reason is None else \
                    calls.finish(delta.text, delta.finish_reason)
            if step.content:  # the message's text carries the logprobs of the tokens up to it, as vLLM's
                logprobs, held = _logprob_dicts(reply, held), []
            finish_reason = step.finish_reason or finish_reason
            for line in output.add(step, logprobs):
                yield line
    for line in output.close("incomplete" if finish_reason == "length" else "completed",
                             _logprob_dicts(reply, held)):
        yield line
    yield draft.closing(draft.complete(output.items, finish_reason, reply.usage()))


def _logprob_dicts(reply: Any, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """The Responses API's logprobs of `entries` ([] unless the request asked for them)."""
    formatted = reply.logprobs(entries) if entries else None
    return formatted.model_dump()["content"] if formatted is not None else []


class _Output:
    """The output items so far; the last one may still be open (getting deltas)."""

    def __init__(self, draft: ResponseDraft):
        self.draft = draft
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None

    def add(self, step: StreamStep, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        events = self._text(step.content, logprobs or []) if step.content else []
        for call in step.tool_calls:  # a call's first piece has its id and name; the next ones, arguments
            events += self._new_call(call) if "id" in call else self._arguments(call["function"]["arguments"])
        return events

    def close(self, status: str, logprobs: list[dict[str, Any]]) -> list[str]:
        """The end of the reply: the open item gets `status` (a message, the `logprobs`
        of tokens that showed no text); a reply without any output is one empty
        message, as the non-stream reply."""
        events = self._text("", []) if not self.items else []
        if logprobs and self.open is not None and self.open["type"] == "message":
            self.open["content"][0]["logprobs"] += logprobs
        return events + self._finish_open(status)

    def _place(self, **fields: Any) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, **fields}

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._finish_open("completed")
            events += self._start(message_item("", "in_progress", new_item_id("msg")))
            events.append(self.draft.event("response.content_part.added", **self._place(content_index=0),
                                           part=text_part("")))
        if text:
            self.open["content"][0]["text"] += text
            self.open["content"][0]["logprobs"] += logprobs
            events.append(self.draft.event("response.output_text.delta", **self._place(content_index=0),
                                           delta=text, logprobs=logprobs))
        return events

    def _new_call(self, call: dict[str, Any]) -> list[str]:
        function = call["function"]
        events = self._finish_open("completed")
        events += self._start(function_call_item(call_id_of(call["id"]), function["name"], "", "in_progress"))
        return events + self._arguments(function.get("arguments") or "")

    def _arguments(self, fragment: str) -> list[str]:
        if not fragment:
            return []
        self.open["arguments"] += fragment
        return [self.draft.event("response.function_call_arguments.delta", **self._place(), delta=fragment)]

    def _start(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = item
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        return [self.draft.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _finish_open(self, status: str) -> list[str]:
        item = self.open
        if item is None:
            return []
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.draft.event("response.output_text.done", **self._place(content_index=0),
                                       text=part["text"], logprobs=part["logprobs"]),
                      self.draft.event("response.content_part.done", **self._place(content_index=0), part=part)]
        else:
            events = [self.draft.event("response.function_call_arguments.done", **self._place(),
                                       arguments=item["arguments"], name=item["name"])]
        item["status"] = status
        events.append(self.draft.event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        self.open = None
        return events
