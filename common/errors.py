"""Errors shared by every process; each maps to an HTTP status and a gRPC code."""
from __future__ import annotations


class PagedServeError(Exception):
    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


class InvalidRequestError(PagedServeError):
    """The client sent something we will not run (HTTP 400 / INVALID_ARGUMENT)."""
    http_status = 400
    error_type = "invalid_request_error"


class ConfigError(ValueError):
    """A bad engine or server setting, reported at startup."""


# The exit status of a usage error: a flag or setting (or a file one names) that a
# component cannot run with. argparse exits with it too; a restart would fail the
# same way, so `serve` does not restart a component that exits with it.
USAGE_ERROR = 2
