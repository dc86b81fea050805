"""How a generation route answers: a stream of server-sent events, or one JSON
body once the work is done, unless the client left first."""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import Request

from frontend.openai import sse
from frontend.openai.async_utils import cancel_on_disconnect


def event_stream(events: AsyncIterator[str],
                 on_error: Callable[[Exception], list[str]] = sse.error_and_done) -> StreamingResponse:
    """`events` as server-sent events; a failure midway becomes its last events
    (`on_error`; by default an OpenAI error event, then [DONE])."""
    return StreamingResponse(sse.with_error_events(events, on_error), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


async def json_reply(raw_request: Request, work: Awaitable[BaseModel | dict[str, Any]]) -> Response:
    """The work's result as JSON; if the client disconnects first, the work is
    cancelled (aborting its requests) and nobody reads the 499."""
    completed, result = await cancel_on_disconnect(raw_request, work)
    if not completed:
        return Response(status_code=499)  # nginx's "client closed request"
    return JSONResponse(result.model_dump() if isinstance(result, BaseModel) else result)
