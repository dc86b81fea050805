"""One response of the Responses API as it is made: its object (in progress,
then final), its stream events' sequence numbers, and, once complete, its
place in the store (the conversation a next response continues, and the
items input_items lists)."""
from __future__ import annotations

import json
import time
from typing import Any

from common.sampling_params import SamplingParams
from frontend.openai import sse
from frontend.openai.response_bodies import ChatCompletionResponse, UsageInfo
from frontend.openai.responses_items import call_id_of, function_call_item, message_item, usage_object
from frontend.openai.responses_request import ResponsesRequest
from frontend.responses_store import StoredResponse
from frontend.frontend_state import FrontendState


class ResponseDraft:
    def __init__(self, state: FrontendState, body: ResponsesRequest, response_id: str, created: int,
                 conversation: list[dict[str, Any]], input_items: list[dict[str, Any]],
                 params: SamplingParams | None = None):
        self.state, self.body, self.id, self.created = state, body, response_id, created
        self.params = params  # the values used, which the response reports (as OpenAI's and vLLM's)
        self.conversation = conversation  # chat messages, without the instructions: they do not carry over
        self.input_items = input_items  # what the response is made from, as input_items lists it
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def error_event(self, error: Exception) -> list[str]:
        """A failure after the stream started: the Responses API's error event."""
        body = sse.error_body(error)
        return [self.event("error", code=str(body["code"]), message=body["message"], param=body["param"])]

    def opening(self) -> list[str]:
        started = self.response("in_progress")
        return [self.event("response.created", response=started),
                self.event("response.in_progress", response=started)]

    def closing(self, final: dict[str, Any]) -> str:
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return self.event(kind, response=final)

    def response(self, status: str, output: list[dict[str, Any]] | None = None,
                 usage: UsageInfo | None = None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.state.model_name, "output": output or [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": self.params.temperature if self.params else body.temperature,
            "top_p": self.params.top_p if self.params else body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",  # OpenAI's default, tools or not
            "parallel_tool_calls": body.parallel_tool_calls, "truncation": body.truncation or "disabled",
            "reasoning": {"effort": None, "summary": None}, "metadata": body.metadata or {}, "user": body.user,
            "background": False, "usage": usage_object(usage) if usage is not None else None,
            "top_logprobs": body.top_logprobs, "max_tool_calls": body.max_tool_calls,
        }

    def finish_chat(self, chat_response: ChatCompletionResponse) -> dict[str, Any]:
        """The final response of a complete chat reply (not streamed)."""
        choice = chat_response.choices[0]
        content, chat_calls = choice.message.content, getattr(choice.message, "tool_calls", None) or []
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        # Logprobs belong to the text: a reply with calls reports none (streamed, the text before
        # the calls has already gone out with its tokens' logprobs, as vLLM streams them).
        logprobs = [] if chat_calls or choice.logprobs is None else \
            choice.logprobs.model_dump()["content"] or []
        output = [message_item(content or "", status, logprobs=logprobs)] if content or not chat_calls else []
        output += [function_call_item(call_id_of(call["id"]), call["function"]["name"],
                                      call["function"]["arguments"], "completed") for call in chat_calls]
        return self.complete(output, choice.finish_reason, chat_response.usage)

    def complete(self, output: list[dict[str, Any]], finish_reason: str | None, usage: UsageInfo) -> dict[str, Any]:
        """The final response object, made of `output` (stored when asked)."""
        final = self.response("incomplete" if finish_reason == "length" else "completed", output, usage)
        if self.body.store:
            self.state.responses.put(StoredResponse(final, [*self.conversation, _reply_message(output)],
                                                    self.input_items))
        return final


def _reply_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the assistant's chat message, for the next response's prompt."""
    content = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message
