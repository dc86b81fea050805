"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and
DELETE /v1/responses/{id}. A response is a chat completion underneath
(`frontend.responses_request` makes one); its reply comes back as output
items: a message with output_text, or function calls.

A stream sends the Responses API's events (`event: <type>` lines, each with a
sequence_number): response.created, response.in_progress, the output items
(added, their deltas, done) and response.completed (or response.incomplete
when max_output_tokens cut it). Text streams as it is generated; a reply that
may hold tool calls is sent once it is complete.
"""
from __future__ import annotations

import json
import secrets
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequestError, PagedServeError
from frontend import sse
from frontend.generation import GenerationDelta
from frontend.openai_responses import ChatCompletionResponse, UsageInfo
from frontend.replies import event_stream, json_reply
from frontend.responses_request import ResponsesRequest, speak_responses
from frontend.responses_store import StoredResponse
from frontend.serving_chat import collect_chat_completion, start_chat_generation
from frontend.state import FrontendState


class ResponseNotFoundError(PagedServeError):
    http_status = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


async def create_response(state: FrontendState, body: ResponsesRequest, raw_request: Request) -> Response:
    body.check_supported()
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise ResponseNotFoundError(body.previous_response_id, param="previous_response_id")
        history = previous.conversation
    chat = body.chat_request(history)
    try:
        reply, deltas = await start_chat_generation(state, chat, raw_request, "resp")
    except InvalidRequestError as e:  # name the Responses field the client sent
        raise speak_responses(e)
    draft = _Draft(state, body, reply.id, reply.created, history + body.input_messages())
    if body.stream:
        stream = _stream(draft, reply, deltas) if chat.resolved_tool_choice().mode == "none" \
            else _stream_when_complete(draft, collect_chat_completion(reply, deltas))
        return event_stream(stream, draft.error_event)
    return await json_reply(raw_request, _finished(draft, collect_chat_completion(reply, deltas)))


async def _finished(draft: "_Draft", collected: Awaitable[ChatCompletionResponse]) -> dict[str, Any]:
    return draft.finish_chat(await collected)


def retrieve_response(state: FrontendState, response_id: str) -> dict[str, Any]:
    stored = state.responses.get(response_id)
    if stored is None:
        raise ResponseNotFoundError(response_id)
    return stored.body


def delete_response(state: FrontendState, response_id: str) -> dict[str, Any]:
    if not state.responses.delete(response_id):
        raise ResponseNotFoundError(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


class _Draft:
    """The response object as it grows, and its events' sequence numbers."""

    def __init__(self, state: FrontendState, body: ResponsesRequest, response_id: str, created: int,
                 conversation: list[dict[str, Any]]):
        self.state, self.body, self.id, self.created = state, body, response_id, created
        self.conversation = conversation  # without the instructions: they do not carry to a next response
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def error_event(self, error: Exception) -> list[str]:
        """A failure after the stream started: the Responses API's error event."""
        body = sse.error_body(error)
        return [self.event("error", code=str(body["code"]), message=body["message"], param=body["param"])]

    def response(self, status: str, output: list[dict[str, Any]] | None = None, usage: UsageInfo | None = None,
                 incomplete: bool = False) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.state.model_name, "output": output or [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p, "text": body.text or {"format": {"type": "text"}},
            "tools": body.tools or [], "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls, "truncation": body.truncation or "disabled",
            "reasoning": {"effort": None, "summary": None}, "metadata": body.metadata or {}, "user": body.user,
            "background": False, "usage": _usage(usage) if usage is not None else None,
        }

    def finish_chat(self, chat_response: ChatCompletionResponse) -> dict[str, Any]:
        choice = chat_response.choices[0]
        return self.finish(choice.message.content, getattr(choice.message, "tool_calls", None), choice.finish_reason,
                           chat_response.usage)

    def finish(self, content: str | None, tool_calls: list[dict[str, Any]] | None, finish_reason: str | None,
               usage: UsageInfo, message_id: str | None = None) -> dict[str, Any]:
        """The final response object of a complete reply (stored when asked)."""
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        output: list[dict[str, Any]] = []
        if content or not tool_calls:
            output.append(_message_item(content or "", status, message_id))
        output += [_function_call_item(call) for call in tool_calls or []]
        final = self.response(status, output, usage, incomplete)
        if self.body.store:
            reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
            if tool_calls:
                reply["tool_calls"] = tool_calls
            self.state.responses.put(StoredResponse(final, [*self.conversation, reply]))
        return final


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{secrets.token_hex(16)}", "status": status,
            "role": "assistant", "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{secrets.token_hex(16)}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _usage(usage: UsageInfo) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": (usage.prompt_tokens_details or {}).get("cached_tokens", 0)},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def _opening(draft: _Draft) -> list[str]:
    started = draft.response("in_progress")
    return [draft.event("response.created", response=started), draft.event("response.in_progress", response=started)]


def _closing(draft: _Draft, final: dict[str, Any]) -> str:
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    return draft.event(kind, response=final)


async def _stream(draft: _Draft, reply: Any, deltas: AsyncIterator[GenerationDelta]) -> AsyncIterator[str]:
    """Free text: each piece goes out as it is generated."""
    for line in _opening(draft):
        yield line
    item_id = f"msg_{secrets.token_hex(16)}"
    place = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield draft.event("response.output_item.added", output_index=0, item=_message_item("", "in_progress", item_id)
                      | {"content": []})
    yield draft.event("response.content_part.added", **place, part=_text_part(""))
    text, finish_reason = "", None
    async with aclosing(deltas):
        async for delta in deltas:
            reply.last = delta
            finish_reason = delta.finish_reason or finish_reason
            if delta.text:
                text += delta.text
                yield draft.event("response.output_text.delta", **place, delta=delta.text, logprobs=[])
    status = "incomplete" if finish_reason == "length" else "completed"
    yield draft.event("response.output_text.done", **place, text=text, logprobs=[])
    yield draft.event("response.content_part.done", **place, part=_text_part(text))
    yield draft.event("response.output_item.done", output_index=0, item=_message_item(text, status, item_id))
    yield _closing(draft, draft.finish(text, None, finish_reason, reply.usage(), message_id=item_id))


async def _stream_when_complete(draft: _Draft, collected: Any) -> AsyncIterator[str]:
    """A reply that may hold tool calls: its items go out once it is complete."""
    for line in _opening(draft):
        yield line
    final = draft.finish_chat(await collected)
    for index, item in enumerate(final["output"]):
        yield draft.event("response.output_item.added", output_index=index, item=_in_progress(item))
        if item["type"] == "message":
            place = {"item_id": item["id"], "output_index": index, "content_index": 0}
            text = item["content"][0]["text"]
            yield draft.event("response.content_part.added", **place, part=_text_part(""))
            yield draft.event("response.output_text.delta", **place, delta=text, logprobs=[])
            yield draft.event("response.output_text.done", **place, text=text, logprobs=[])
            yield draft.event("response.content_part.done", **place, part=_text_part(text))
        else:
            place = {"item_id": item["id"], "output_index": index}
            yield draft.event("response.function_call_arguments.delta", **place, delta=item["arguments"])
            yield draft.event("response.function_call_arguments.done", **place, arguments=item["arguments"],
                              name=item["name"])
        yield draft.event("response.output_item.done", output_index=index, item=item)
    yield _closing(draft, final)


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    return {**item, "status": "in_progress", "arguments": ""}
