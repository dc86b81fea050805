"""The OpenAI-compatible HTTP API (FastAPI): `build_app(state)`.

Every error, including a malformed body, answers with OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`: 400 for bad input (never
FastAPI's 422), 401 for a missing or wrong API key, 404 for an unknown model,
413 for a body above the size limit, 429 (with Retry-After) while the
scheduler's queue is full, 503 when the engine is unavailable, 504 when a
request outlives --request-timeout.
"""
from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import InvalidRequestError, PagedServeError
from frontend.http_guards import GuardRefusal, RequestGuard
from frontend.frontend_options import CorsSettings
from frontend.openai.request_bodies import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from frontend.openai.embeddings import EmbeddingRequest, create_embedding
from frontend.openai.serving_chat import create_chat_completion
from frontend.openai.responses_request import ResponsesRequest
from frontend.openai.serving_completions import create_completion
from frontend.openai.serving_responses import (cancel_response, create_response, delete_response, list_input_items,
                                               retrieve_response)
from frontend.openai.serving_tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from frontend.frontend_state import FrontendState
from frontend.playground_routes import add_playground
from frontend.openai.lora_routes import add_lora_routes, runtime_lora_updating_allowed

logger = logging.getLogger(__name__)


def server_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "0.1.0"


def error_response(error: PagedServeError) -> JSONResponse:
    retry_after = getattr(error, "retry_after_s", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error.to_openai(), status_code=error.http_status, headers=headers)


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """FastAPI's validation failure as a 400 naming the offending parameter."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"the request body is not valid JSON: {first.get('msg', '')}")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Unions add the tried type as a location part ("prompt.str"); the field path is what clients need.
    param = ".".join(p for p in location if not _is_type_name(p)) or None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return InvalidRequestError(message, param=param)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list") or part.startswith(("list[", "dict[", "function-"))


def build_app(state: FrontendState, *, api_key: str | None = None, max_body_bytes: int | None = None,
              cors: CorsSettings | None = None, playground: bool = True) -> FastAPI:
    """The API; with `api_key`, /v1 routes need it; bodies above `max_body_bytes` get 413;
    `cors`: which browser pages may call it (None: no CORS headers, browsers refuse them);
    `playground`: serve the playground page at `/` (frontend/playground_routes.py)."""
    app = FastAPI(title="pagedserve", version=server_version(), docs_url=None, redoc_url=None)
    app.state.frontend = state
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    if cors is not None:
        # Added last, so outermost: a preflight (which carries no API key) is answered before the
        # guard, and the guard's refusals carry CORS headers too, so a page can read them.
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)

    @app.exception_handler(PagedServeError)
    async def _pagedserve_error(request: Request, exc: PagedServeError) -> JSONResponse:
        if exc.http_status >= 500:
            logger.warning("%s %s failed: %s", request.method, request.url.path, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, GuardRefusal):
            return error_response(exc.error)
        # Unknown routes and methods, in the same error shape as everything else.
        error = PagedServeError(str(exc.detail))
        error.http_status, error.error_type = exc.status_code, "invalid_request_error"
        return JSONResponse(error.to_openai(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(PagedServeError("internal server error"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(state, body, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(state, body, raw_request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
        return await create_embedding(state, body, raw_request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw_request: Request) -> Response:
        return await create_response(state, body, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse(retrieve_response(state, response_id, raw_request.query_params))

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str) -> JSONResponse:
        return JSONResponse(delete_response(state, response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse(list_input_items(state, response_id, raw_request.query_params))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        return JSONResponse(cancel_response(state, response_id))

    async def model_cards() -> list[ModelCard]:
        max_model_len = await state.max_model_len()
        return [ModelCard(id=name, created=state.created, root=state.model_root, max_model_len=max_model_len)
                for name in state.served_model_names] + [
            ModelCard(id=name, created=state.created, root=lora.lora_path, parent=state.model_name,
                      max_model_len=max_model_len) for name, lora in state.lora_modules.requests.items()]

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=await model_cards()).model_dump())

    # The openai client's `models.retrieve(id)`; ids may hold slashes ("org/name").
    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        state.check_model(model)
        card = next(card for card in await model_cards() if card.id == model)
        return JSONResponse(card.model_dump())

    if runtime_lora_updating_allowed():
        add_lora_routes(app, state)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenize(state, body)).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await detokenize(state, body)).model_dump())

    @app.get("/health")
    async def health() -> Response:
        healthy, reason = await state.is_healthy()
        if healthy:
            return Response(status_code=200)
        return JSONResponse({"error": {"message": reason, "type": "service_unavailable", "param": None,
                                       "code": None}}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await state.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def server_version_route() -> JSONResponse:
        return JSONResponse({"version": server_version()})

    if playground:
        add_playground(app)
    return app
