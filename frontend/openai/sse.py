"""Server-sent events as the OpenAI API streams them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""
from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

from pydantic import BaseModel

from common.errors import PagedServeError

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens


def event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def error_body(error: Exception) -> dict:
    """The OpenAI error object of a failure after the stream started (the status line is already sent)."""
    if not isinstance(error, PagedServeError):
        logger.exception("error while streaming", exc_info=error)
        error = PagedServeError("internal error while generating")
    body = error.to_openai()["error"]
    body["code"] = body["code"] or error.http_status
    return body


def error_event(error: Exception) -> str:
    return f"data: {json.dumps({'error': error_body(error)})}\n\n"


def error_and_done(error: Exception) -> list[str]:
    """The OpenAI streams' ending after a failure: an error event, then [DONE]."""
    return [error_event(error), DONE]


async def with_error_events(events: AsyncIterator[str],
                            on_error: Callable[[Exception], list[str]] = error_and_done) -> AsyncIterator[str]:
    """Turn an exception in the middle of a stream into its last events (by
    default an error event, then [DONE])."""
    try:
        async with aclosing(events):
            async for item in events:
                yield item
    except Exception as e:  # noqa: BLE001 - every failure must reach the client as an event
        for item in on_error(e):
            yield item
