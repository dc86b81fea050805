"""The one error the tokenizer pool adds: it could not answer at all."""
from __future__ import annotations

from common.errors import PagedServeError

# Replies the router makes up itself (overload, lost workers) carry status 503
# and this prefix, so the message alone says where it came from.
POOL_ERROR_PREFIX = "tokenizer pool unavailable: "
UNAVAILABLE_STATUS = 503


class TokenizerUnavailableError(PagedServeError):
    """No tokenizer worker answered in time, or the pool gave up on the job."""
    http_status = 503
    error_type = "service_unavailable"
