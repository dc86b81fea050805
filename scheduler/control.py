"""The scheduler's gRPC control service (health, model info, stats, prefix-cache reset).

It runs on grpc's own threads and never touches the scheduler directly: it
reads a snapshot the engine loop publishes after every step, and asks the loop
to do anything that changes state. Its TLS and tokens: start_control_server.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import grpc

from common.addresses import GRPC_SERVER_OPTIONS, bind_grpc_port
from common.grpc_gen import control_pb2, control_pb2_grpc
from common.protocol import WorkerHello
from common.tls_files import TlsFiles
from scheduler.control_auth import ControlTokenInterceptor


@dataclass
class ControlSnapshot:
    """What the control service may read; replaced wholesale by the engine loop."""
    worker: WorkerHello | None = None  # the model's shape; kept while a lost worker is replaced
    worker_ready: bool = False  # a worker is registered right now
    status: str = "waiting for a worker"
    stats: dict = field(default_factory=dict)


LOOP_STALL_S = 10.0  # an engine loop silent this long is reported unhealthy


class ControlState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot = ControlSnapshot()
        self.loop_heartbeat = time.monotonic()  # written by the engine loop every iteration

    def loop_alive(self) -> bool:
        return time.monotonic() - self.loop_heartbeat < LOOP_STALL_S

    def publish(self, snapshot: ControlSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def read(self) -> ControlSnapshot:
        with self._lock:
            return self._snapshot


class SchedulerControlServicer(control_pb2_grpc.SchedulerControlServicer):
    def __init__(self, state: ControlState, model_name: str,
                 request_reset: Callable[[], "futures.Future[bool]"], max_logprobs: int = 20):
        self._state = state
        self._model_name = model_name
        self._request_reset = request_reset
        self._max_logprobs = max_logprobs  # --max-logprobs: frontends check requests against it

    def Health(self, request, context):
        """ok: the engine loop runs (requests in its hands are safe, even while
        no worker is registered); worker_ready: it can make progress now."""
        snapshot = self._state.read()
        if not self._state.loop_alive():
            return control_pb2.HealthReply(ok=False, worker_ready=snapshot.worker_ready,
                                           message="the engine loop is stalled")
        return control_pb2.HealthReply(ok=True, worker_ready=snapshot.worker_ready, message=snapshot.status)

    def GetModelInfo(self, request, context):
        worker = self._state.read().worker
        if worker is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no worker has registered yet")
        return control_pb2.ModelInfo(model=self._model_name, max_model_len=worker.max_model_len,
                                     block_size=worker.block_size, num_blocks=worker.num_blocks,
                                     vocab_size=worker.vocab_size, dtype=worker.dtype,
                                     eos_token_ids=worker.eos_token_ids, max_logprobs=self._max_logprobs)

    def GetStats(self, request, context):
        stats = self._state.read().stats
        fields = control_pb2.SchedulerStats.DESCRIPTOR.fields_by_name
        return control_pb2.SchedulerStats(**{k: v for k, v in stats.items() if k in fields})

    def ResetPrefixCache(self, request, context):
        try:
            ok = self._request_reset().result(timeout=10)
        except futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the engine loop did not answer in time")
        return control_pb2.ResetPrefixCacheReply(ok=ok)


def start_control_server(address: str, servicer: SchedulerControlServicer, *, tokens: list[str] | None = None,
                         tls: TlsFiles | None = None) -> grpc.Server:
    """Serve on `address`: over TLS only with `tls`, and with `tokens` requiring one of
    them on every call but Health (scheduler/control_auth.py); open without."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="control"),
                         interceptors=[ControlTokenInterceptor(tokens)] if tokens else None,
                         options=GRPC_SERVER_OPTIONS)
    control_pb2_grpc.add_SchedulerControlServicer_to_server(servicer, server)
    bind_grpc_port(server, address, tls.server_credentials() if tls else None)
    server.start()
    return server
