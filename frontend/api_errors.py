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


class OverloadedError(PagedServeError):
    """The scheduler's waiting queue is full (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED)."""
    http_status = 429
    error_type = "overloaded_error"
    retry_after_s = 1

    def __init__(self, message: str = "The server is overloaded: too many requests are waiting; retry later"):
        super().__init__(message, code="server_overloaded")


class RequestTimeoutError(PagedServeError):
    """The request did not finish within the frontend's --request-timeout (HTTP 504, gRPC DEADLINE_EXCEEDED)."""
    http_status = 504
    error_type = "timeout_error"

    def __init__(self, timeout_s: float):
        super().__init__(f"The request did not finish within the server's request timeout of {timeout_s:g}s",
                         code="request_timeout")


class AuthenticationError(PagedServeError):
    """A missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""
    http_status = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str = "Missing or incorrect API key: send it as 'Authorization: Bearer <key>'"):
        super().__init__(message, code="invalid_api_key")


class PayloadTooLargeError(PagedServeError):
    """A request body above the frontend's --max-request-body-size (HTTP 413)."""
    http_status = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int):
        super().__init__(f"The request body is larger than the server's limit of {limit} bytes",
                         code="request_too_large")


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
    if status == 429:
        return OverloadedError(message)
    error = PagedServeError(message)
    error.http_status = status
    return error


_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(error: PagedServeError) -> grpc.StatusCode:
    return _GRPC_CODES.get(error.http_status, grpc.StatusCode.INTERNAL)
