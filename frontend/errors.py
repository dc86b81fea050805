"""Frontend error kinds beyond common.errors, and their HTTP / gRPC mapping."""
from __future__ import annotations

import grpc

from common.errors import InvalidRequestError, PagedServeError


class ModelNotFoundError(PagedServeError):
    """The request names a model this server does not serve (HTTP 404)."""
    http_status = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


class ServiceUnavailableError(PagedServeError):
    """The scheduler (or tokenizer pool) cannot take or finish the request (HTTP 503)."""
    http_status = 503
    error_type = "service_unavailable"


class NotSupportedError(InvalidRequestError):
    """A valid OpenAI parameter this server does not implement yet (HTTP 400)."""

    def __init__(self, param: str, what: str | None = None):
        super().__init__(f"{what or param} is not supported yet", param=param, code="not_supported")


def error_with_status(message: str, status: int) -> PagedServeError:
    """An error carrying an arbitrary HTTP status (e.g. from a scheduler EngineError)."""
    if status == 400:
        return InvalidRequestError(message)
    if status == 503:
        return ServiceUnavailableError(message)
    error = PagedServeError(message)
    error.http_status = status
    return error


_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    503: grpc.StatusCode.UNAVAILABLE,
}


def grpc_code(error: PagedServeError) -> grpc.StatusCode:
    return _GRPC_CODES.get(error.http_status, grpc.StatusCode.INTERNAL)
