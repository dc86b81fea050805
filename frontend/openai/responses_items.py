"""The items of the Responses API as OpenAI returns them: output items (a
message with output_text, function calls), the input items a stored response
was made from (GET /v1/responses/{id}/input_items), and the usage object.

Ids take OpenAI's prefixes, as vLLM's do: msg_ for messages, fc_ for function
call items, call_ for the calls' call_id (unless the tool-call parser makes its
own, as Mistral's), fco_ for their outputs.
"""
from __future__ import annotations

import secrets
from typing import Any

from common.errors import InvalidRequestError
from frontend.openai.response_bodies import UsageInfo

MAX_LISTED_ITEMS = 100  # OpenAI's bound on `limit`


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def call_id_of(chat_call_id: str) -> str:
    """The call_id of a chat tool call ("chatcmpl-tool-<hex>" -> "call_<hex>"): the
    same call always gets the same id, streamed or not. A parser's own ids stay
    (Mistral's 9 letters and digits: its chat templates accept no other back)."""
    if chat_call_id.startswith("chatcmpl-tool-"):
        return "call_" + chat_call_id.removeprefix("chatcmpl-tool-")
    return chat_call_id


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`logprobs`: per token of `text`, {token, logprob, bytes, top_logprobs}, when asked."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str, status: str, item_id: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_item_id("msg"), "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)]}


def function_call_item(call_id: str, name: str, arguments: str, status: str,
                       item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def usage_object(usage: UsageInfo) -> dict[str, Any]:
    # cache_write_tokens: OpenAI's explicit prompt caching, which this server does not have.
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def input_item_resources(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` (already checked by `ResponsesRequest.input_messages`) as
    the items input_items lists: each with an id (the client's, else a new one)."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return [_resource(item) for item in items]


def _resource(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        return function_call_item(item["call_id"], item["name"], item["arguments"], "completed", item.get("id"))
    if kind == "function_call_output":
        output = item["output"]
        if not isinstance(output, str):
            output = [{"type": "input_text", "text": part["text"]} for part in output]
        return {"type": "function_call_output", "id": item.get("id") or new_item_id("fco"),
                "call_id": item["call_id"], "output": output, "status": "completed"}
    content = item["content"]
    if item["role"] == "assistant":
        texts = [content] if isinstance(content, str) else [part["text"] for part in content]
        return {"type": "message", "id": item.get("id") or new_item_id("msg"), "status": "completed",
                "role": "assistant", "content": [text_part(text) for text in texts]}
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else \
        [{"type": "input_text", "text": part["text"]} for part in content]
    return {"type": "message", "id": item.get("id") or new_item_id("msg"), "status": "completed",
            "role": item["role"], "content": parts}


def item_list(items: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """One page of `items` (oldest first), as OpenAI lists them: `order` "desc"
    is newest first, `after` the id of the last item of the previous page."""
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    if not 1 <= limit <= MAX_LISTED_ITEMS:
        raise InvalidRequestError(f"limit must be between 1 and {MAX_LISTED_ITEMS}, got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequestError(f"No input item with id '{after}' in this response.", param="after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
