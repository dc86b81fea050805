"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), and for a
stored response GET and DELETE /v1/responses/{id}, GET .../input_items and
POST .../cancel. A response is a chat completion underneath
(`frontend.openai.responses_request` makes one); its reply comes back as output
items (`responses_items`): a message with output_text, or function calls.
A stream sends the API's events as the reply is generated (`responses_stream`).

No response runs in the background here: every one is finished (or gone)
before anyone else can see it, so none can be cancelled, and a stored one
cannot be streamed again.
"""
from __future__ import annotations

from typing import Any, Awaitable

from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import QueryParams

from common.errors import InvalidRequestError, PagedServeError
from frontend.api_errors import NotSupportedError
from frontend.openai.response_bodies import ChatCompletionResponse
from frontend.openai.http_replies import event_stream, json_reply
from frontend.openai.responses_draft import ResponseDraft
from frontend.openai.responses_items import input_item_resources, item_list
from frontend.openai.responses_request import ResponsesRequest, speak_responses
from frontend.responses_store import StoredResponse
from frontend.openai.responses_stream import response_events
from frontend.openai.serving_chat import collect_chat_completion, start_chat_generation
from frontend.frontend_state import FrontendState
from frontend.openai.tool_call_stream import tool_call_stream

DEFAULT_LISTED_ITEMS = 20  # OpenAI's default `limit` of input_items


class ResponseNotFoundError(PagedServeError):
    http_status = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


async def create_response(state: FrontendState, body: ResponsesRequest, raw_request: Request) -> Response:
    body.check_supported()
    history: list[dict[str, Any]] = []
    history_items: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise ResponseNotFoundError(body.previous_response_id, param="previous_response_id")
        history, history_items = previous.conversation, previous.input_items + previous.body["output"]
    chat = body.chat_request(history)
    try:
        reply, deltas = await start_chat_generation(state, chat, raw_request, "resp_")
    except InvalidRequestError as e:  # name the Responses field the client sent
        raise speak_responses(e)
    draft = ResponseDraft(state, body, reply.id, reply.created, history + body.input_messages(),
                          history_items + input_item_resources(body.input), reply.params)
    if body.stream:
        calls = tool_call_stream(chat.resolved_tool_choice())
        return event_stream(response_events(draft, reply, deltas, calls), draft.error_event)
    return await json_reply(raw_request, _finished(draft, collect_chat_completion(reply, deltas)))


async def _finished(draft: ResponseDraft, collected: Awaitable[ChatCompletionResponse]) -> dict[str, Any]:
    return draft.finish_chat(await collected)


def _stored(state: FrontendState, response_id: str) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise ResponseNotFoundError(response_id)
    return stored


def retrieve_response(state: FrontendState, response_id: str, query: QueryParams) -> dict[str, Any]:
    stored = _stored(state, response_id)
    # Streaming a response again is for background responses (none here); answering
    # JSON to a client that asked for events would leave it with an empty stream.
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise NotSupportedError("stream", "streaming a stored response (only background responses can be, "
                                          "and there are none here)")
    if query.get("starting_after") is not None:
        raise NotSupportedError("starting_after", "starting_after (only for streaming background responses)")
    _check_no_include(query)
    return stored.body


def delete_response(state: FrontendState, response_id: str) -> dict[str, Any]:
    if not state.responses.delete(response_id):
        raise ResponseNotFoundError(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def cancel_response(state: FrontendState, response_id: str) -> dict[str, Any]:
    """Only a background response can be cancelled (OpenAI's rule); there are none here,
    so a known response is a 400, as vLLM answers for one that is not in the background."""
    _stored(state, response_id)
    raise InvalidRequestError("Cannot cancel a response that was not created with background=true "
                              "(background responses are not supported).", param="response_id")


def list_input_items(state: FrontendState, response_id: str, query: QueryParams) -> dict[str, Any]:
    stored = _stored(state, response_id)
    _check_no_include(query)
    limit = query.get("limit", str(DEFAULT_LISTED_ITEMS))
    if not limit.lstrip("-").isdigit():
        raise InvalidRequestError(f"limit must be an integer, got {limit!r}", param="limit")
    return item_list(stored.input_items, query.get("after"), int(limit), query.get("order", "desc"))


def _check_no_include(query: QueryParams) -> None:
    include = query.getlist("include") + query.getlist("include[]")
    if include:
        raise NotSupportedError("include", f"extra output ({', '.join(include)})")
