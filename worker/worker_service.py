"""The worker process: registers with the scheduler, then executes step plans.

The handshake (WorkerHello -> WorkerReady) is retried until the scheduler
answers, so either side may start first or restart. Afterwards the worker
blocks on its socket: it computes only when the scheduler sends a plan.

In a tensor/pipeline-parallel group this service runs on rank 0 only: it hands
every plan (and, while idle, a keepalive) to the other ranks, which follow it
(worker.distributed.group_follower).

A worker started while another one is registered stands by (the scheduler
answers `standby`) and keeps listening: when the registered worker dies, the
scheduler promotes it at once and it carries on the lost worker's requests.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import zmq

from common.protocol import MessageType, Shutdown, StepPlan, WorkerGoodbye, WorkerReady
from common.transport import MessageDecoder, make_socket, recv, send
from worker.distributed.group_leader import GroupLeader

if TYPE_CHECKING:  # torch-free at import: test doubles drive this service too
    from worker.worker import Worker

logger = logging.getLogger(__name__)

HELLO_RETRY_S = 2.0
IDLE_HELLO_S = 2.0  # while idle, re-announce so a restarted scheduler learns about us
GOODBYE_LINGER_MS = 500  # how long closing waits to deliver the goodbye


def worker_identity(rank: int) -> bytes:
    """A readable, unique socket identity: the scheduler's logs name workers by it."""
    return f"worker{rank}-{socket.gethostname()}-{os.getpid()}".encode()


class WorkerService:
    def __init__(self, worker: "Worker", scheduler_address: str, *, handshake_timeout_s: float | None = None):
        self.worker = worker
        self.ctx = zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.DEALER, identity=worker_identity(getattr(worker, "rank", 0)))
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # notice a vanished scheduler host, then reconnect
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        self.sock.connect(scheduler_address)
        self.decoder = MessageDecoder((MessageType.WORKER_READY, MessageType.STEP_PLAN, MessageType.SHUTDOWN))
        self.handshake_timeout_s = handshake_timeout_s
        self.scheduler_id: str | None = None
        self.standing_by = False
        self.running = True
        self.goodbye_sent = False
        self.group = GroupLeader(worker)  # hands plans to the other ranks of a worker group

    def handshake(self) -> None:
        """Say hello until the scheduler accepts; raise if it refuses or times out."""
        hello = self.worker.hello()
        deadline = None if self.handshake_timeout_s is None else time.monotonic() + self.handshake_timeout_s
        while self.running:
            send(self.sock, hello)
            answered = False
            # Keep listening until the next hello: a standby worker is promoted by a message.
            retry_at = time.monotonic() + HELLO_RETRY_S
            while (wait := retry_at - time.monotonic()) > 0 and self.sock.poll(max(1, int(wait * 1000))):
                msg = recv(self.sock, self.decoder)
                if isinstance(msg, WorkerReady):
                    answered = True
                    if self._on_ready(msg):
                        return
            self.group.tell("keepalive")
            if answered:
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no answer from the scheduler")
            logger.info("waiting for the scheduler...")

    def run(self) -> None:
        self.handshake()
        hello = self.worker.hello()
        while self.running:
            if not self.sock.poll(int(IDLE_HELLO_S * 1000)):
                send(self.sock, hello)
                self.group.tell("keepalive")
                continue
            msg = recv(self.sock, self.decoder)
            if isinstance(msg, StepPlan):
                send(self.sock, self.group.execute(msg))
            elif isinstance(msg, Shutdown):
                logger.info("shutdown requested by the scheduler: %s", msg.reason)
                self.group.tell("stop")
                return
            elif isinstance(msg, WorkerReady):
                self._on_ready(msg)
        self._say_goodbye("stopped by a signal")
        self.group.tell("stop")

    def _say_goodbye(self, reason: str) -> None:
        """Tell the scheduler this is no crash: a restart by an operator (or a
        rolling update) must not count against the requests of the last plan."""
        try:
            send(self.sock, WorkerGoodbye(reason=reason), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # no scheduler connected: nobody to tell
        self.goodbye_sent = True

    def _on_ready(self, msg: WorkerReady) -> bool:
        """Apply the scheduler's answer; True once registered."""
        if msg.standby:
            if not self.standing_by:
                logger.warning("standing by: %s", msg.message)
            self.standing_by = True
            self._drop_requests()
            self.scheduler_id = None
            return False
        if not msg.accepted:
            raise RuntimeError(f"the scheduler refused this worker: {msg.message}")
        if msg.scheduler_id != self.scheduler_id:
            if self.scheduler_id is not None:
                # A restarted scheduler, or one that gave us up for lost: what we hold is stale.
                logger.warning("new session with the scheduler: dropping %d stale requests",
                               self.worker.num_requests)
                self._drop_requests()
            else:
                logger.info("registered with the scheduler")
            self.scheduler_id = msg.scheduler_id
            self.standing_by = False
        return True

    def _drop_requests(self) -> None:
        if self.worker.num_requests:
            self.group.reset_requests()

    def close(self) -> None:
        self.running = False
        self.sock.close(linger=GOODBYE_LINGER_MS if self.goodbye_sent else 0)
