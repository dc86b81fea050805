"""Server-sent events as the OpenAI API streams them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""
from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import AsyncIterator

from pydantic import BaseModel

from common.errors import PagedServeError

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens


def event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def error_event(error: Exception) -> str:
    """An error after the stream started (the status line is already sent)."""
    if not isinstance(error, PagedServeError):
        logger.exception("error while streaming", exc_info=error)
        error = PagedServeError("internal error while generating")
    body = error.to_openai()
    body["error"]["code"] = body["error"]["code"] or error.http_status
    return f"data: {json.dumps(body)}\n\n"


async def with_error_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn an exception in the middle of a stream into an error event, then [DONE]."""
    try:
        async with aclosing(events):
            async for item in events:
                yield item
    except Exception as e:  # noqa: BLE001 - every failure must reach the client as an event
        yield error_event(e)
        yield DONE
