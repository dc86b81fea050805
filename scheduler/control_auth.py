"""The control service's gate: every call but Health needs the bearer token
(common/control_token.py), else UNAUTHENTICATED. Health stays open for probes
(container health checks, load balancers), as the frontend's gRPC Health does."""
from __future__ import annotations

import logging

import grpc

from common.control_token import bearer_matches

logger = logging.getLogger(__name__)

OPEN_METHODS = frozenset({"/pagedserve.control.v1.SchedulerControl/Health"})

REFUSAL = ("the scheduler's control service needs the metadata 'authorization: Bearer <token>': the API key "
           "(PAGEDSERVE_API_KEY), or the token derived from the CURVE cluster key (docs/operations.md, Security)")


class ControlTokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, tokens: list[str]):
        if not tokens:
            raise ValueError("no token to require")
        self._tokens = list(tokens)
        self._warned = False

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in OPEN_METHODS:
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self._tokens):
            return continuation(handler_call_details)
        # Warned once: a client retrying (or probing) must not flood the log.
        logger.log(logging.DEBUG if self._warned else logging.WARNING,
                   "refused a control call to %s without a valid token", handler_call_details.method)
        self._warned = True
        handler = continuation(handler_call_details)  # its (de)serializers, so the refusal is well formed

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        # Every control method is unary-unary.
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer if handler else None,
                                                   handler.response_serializer if handler else None)
