"""The frontend's client for the scheduler's gRPC control service.

Every call has a short deadline and turns "unreachable" into None/False:
health checks and /metrics must answer quickly even when the scheduler is down.
With `tls` (the frontend's --ssl-* files, which the scheduler serves too) it
connects over TLS only; every call carries `token` (common/control_token.py).
"""
from __future__ import annotations

import logging

import grpc

from common.control_token import bearer_metadata
from common.grpc_gen import control_pb2, control_pb2_grpc
from common.tls_files import TlsFiles

logger = logging.getLogger(__name__)


class ControlClient:
    def __init__(self, address: str, *, timeout: float = 2.0, token: str | None = None, tls: TlsFiles | None = None):
        self.address = address
        self.timeout = timeout
        self._metadata = bearer_metadata(token)
        # Short reconnect backoff: a restarted scheduler must look healthy again
        # within seconds (the default backoff grows to two minutes).
        options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            credentials, tls_options = tls.client_credentials()
            self._channel = grpc.aio.secure_channel(address, credentials, options=options + tls_options)
        self._stub = control_pb2_grpc.SchedulerControlStub(self._channel)
        self._model_info: control_pb2.ModelInfo | None = None
        self._warned = False  # about a misconfiguration, since the last GetStats that went through

    async def close(self) -> None:
        await self._channel.close()

    async def health(self) -> control_pb2.HealthReply | None:
        try:
            return await self._stub.Health(control_pb2.Empty(), timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            self._log_failure("the scheduler's health check", e)
            return None

    async def is_healthy(self) -> bool:
        """The scheduler answers and has a worker (the engine client's stall probe)."""
        reply = await self.health()
        return reply is not None and reply.ok and reply.worker_ready

    async def model_info(self) -> control_pb2.ModelInfo | None:
        """The served model's shape; cached once known (it never changes while
        the scheduler lives, and a restarted one serves the same model)."""
        if self._model_info is None:
            try:
                self._model_info = await self._stub.GetModelInfo(control_pb2.Empty(), timeout=self.timeout,
                                                                 metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                self._log_failure("GetModelInfo", e)
        return self._model_info

    async def stats(self) -> control_pb2.SchedulerStats | None:
        try:
            stats = await self._stub.GetStats(control_pb2.Empty(), timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            self._log_failure("GetStats", e)
            return None
        self._warned = False
        return stats

    def _log_failure(self, call: str, error: grpc.aio.AioRpcError) -> None:
        """A refused token or a failed TLS handshake (one side has --ssl-*, the other not)
        is a misconfiguration: a warning, once until GetStats goes through. An unreachable
        scheduler is routine (it restarts)."""
        details = error.details() or ""
        misconfigured = (error.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
                         or "handshake failed" in details.lower())
        warn = misconfigured and not self._warned
        self._warned |= warn
        logger.log(logging.WARNING if warn else logging.DEBUG, "%s failed: %s %s", call, error.code(), details)
