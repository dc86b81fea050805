"""Checks every HTTP request passes before the API sees it (a pure ASGI
middleware, so streamed responses are untouched):

- the API key: with `--api-key` set, every `/v1/...` route, `/tokenize` and
  `/detokenize` need `Authorization: Bearer <key>` (compared in constant
  time); `/health`, `/metrics` and `/version` stay open for probes and
  scrapers;
- the body size: a body above the limit is refused with 413, from its
  Content-Length when it has one, else as soon as the bytes read pass it.

Refusals use the OpenAI error shape, like every other error of the API.
"""
from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import PagedServeError
from frontend.api_errors import AuthenticationError, PayloadTooLargeError

PROTECTED_PREFIX = "/v1"
# Outside /v1 but using the model's tokenizer: as closed as generation (vLLM leaves them open).
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})


def api_key_matches(authorization: str | None, api_key: str) -> bool:
    """`authorization` is the header (or gRPC metadata) value: "Bearer <key>"."""
    scheme, _, token = (authorization or "").partition(" ")
    # compare_digest takes time independent of where the strings differ.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class GuardRefusal(HTTPException):
    """A refusal raised while the app reads the body: FastAPI passes HTTPExceptions
    through to the app's handler (others become a 400 "error parsing the body")."""

    def __init__(self, error: PagedServeError):
        super().__init__(error.http_status, error.message)
        self.error = error


class RequestGuard:
    def __init__(self, app: ASGIApp, *, api_key: str | None = None, max_body_bytes: int | None = None):
        self.app = app
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and _is_protected(scope["path"]) and not api_key_matches(headers.get("authorization"),
                                                                                 self.api_key):
            await _send_error(send, AuthenticationError(), [(b"www-authenticate", b"Bearer")])
            return
        if self.max_body_bytes is not None:
            declared = headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
                await _send_error(send, PayloadTooLargeError(self.max_body_bytes), [(b"connection", b"close")])
                return
            receive = self._limited(receive)
        await self.app(scope, receive, send)

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that fails once the body passes the limit (a chunked body
        has no Content-Length). The GuardRefusal reaches the app's handler,
        which answers in the OpenAI shape."""
        received = 0
        limit = self.max_body_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise GuardRefusal(PayloadTooLargeError(limit))
            return message
        return limited_receive


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS


async def _send_error(send: Send, error: PagedServeError, extra_headers: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps(error.to_openai()).encode()
    await send({"type": "http.response.start", "status": error.http_status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": body})
