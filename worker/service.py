"""The worker process: registers with the scheduler, then executes step plans.

The handshake (WorkerHello -> WorkerReady) is retried until the scheduler
answers, so either side may start first or restart. Afterwards the worker
blocks on its socket: it computes only when the scheduler sends a plan.
"""
from __future__ import annotations

import logging
import time

import zmq

from common.protocol import MessageType, Shutdown, StepPlan, WorkerReady
from common.transport import MessageDecoder, make_socket, recv, send
from worker.worker import Worker

logger = logging.getLogger(__name__)

HELLO_RETRY_S = 2.0
IDLE_HELLO_S = 2.0  # while idle, re-announce so a restarted scheduler learns about us


class WorkerService:
    def __init__(self, worker: Worker, scheduler_address: str, *, handshake_timeout_s: float | None = None):
        self.worker = worker
        self.ctx = zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=scheduler_address)
        self.decoder = MessageDecoder((MessageType.WORKER_READY, MessageType.STEP_PLAN, MessageType.SHUTDOWN))
        self.handshake_timeout_s = handshake_timeout_s
        self.scheduler_id: str | None = None
        self.running = True

    def handshake(self) -> None:
        """Say hello until the scheduler accepts; raise if it refuses or times out."""
        hello = self.worker.hello()
        deadline = None if self.handshake_timeout_s is None else time.monotonic() + self.handshake_timeout_s
        while self.running:
            send(self.sock, hello)
            if self.sock.poll(int(HELLO_RETRY_S * 1000)):
                msg = recv(self.sock, self.decoder)
                if isinstance(msg, WorkerReady):
                    self._on_ready(msg)
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no answer from the scheduler")
            logger.info("waiting for the scheduler...")

    def run(self) -> None:
        self.handshake()
        hello = self.worker.hello()
        while self.running:
            if not self.sock.poll(int(IDLE_HELLO_S * 1000)):
                send(self.sock, hello)
                continue
            msg = recv(self.sock, self.decoder)
            if isinstance(msg, StepPlan):
                send(self.sock, self.worker.execute(msg))
            elif isinstance(msg, Shutdown):
                logger.info("shutdown requested by the scheduler: %s", msg.reason)
                return
            elif isinstance(msg, WorkerReady):
                self._on_ready(msg)

    def _on_ready(self, msg: WorkerReady) -> None:
        if not msg.accepted:
            raise RuntimeError(f"the scheduler refused this worker: {msg.message}")
        if msg.scheduler_id != self.scheduler_id:
            if self.scheduler_id is not None:
                logger.warning("the scheduler restarted: dropping %d stale requests", self.worker.num_requests)
                self.worker.reset_requests()
            else:
                logger.info("registered with the scheduler")
            self.scheduler_id = msg.scheduler_id

    def close(self) -> None:
        self.running = False
        self.sock.close(linger=0)
