"""The frontend's client for the scheduler's gRPC control service.

Every call has a short deadline and turns "unreachable" into None/False:
health checks and /metrics must answer quickly even when the scheduler is down.
"""
from __future__ import annotations

import logging

import grpc

from common.grpc_gen import control_pb2, control_pb2_grpc

logger = logging.getLogger(__name__)


class ControlClient:
    def __init__(self, address: str, *, timeout: float = 2.0):
        self.address = address
        self.timeout = timeout
        # Short reconnect backoff: a restarted scheduler must look healthy again
        # within seconds (the default backoff grows to two minutes).
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000)])
        self._stub = control_pb2_grpc.SchedulerControlStub(self._channel)
        self._model_info: control_pb2.ModelInfo | None = None

    async def close(self) -> None:
        await self._channel.close()

    async def health(self) -> control_pb2.HealthReply | None:
        try:
            return await self._stub.Health(control_pb2.Empty(), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            logger.debug("scheduler health check failed: %s", e.code())
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
                self._model_info = await self._stub.GetModelInfo(control_pb2.Empty(), timeout=self.timeout)
            except grpc.aio.AioRpcError as e:
                logger.debug("GetModelInfo failed: %s", e.code())
        return self._model_info

    async def stats(self) -> control_pb2.SchedulerStats | None:
        try:
            return await self._stub.GetStats(control_pb2.Empty(), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            logger.debug("GetStats failed: %s", e.code())
            return None
