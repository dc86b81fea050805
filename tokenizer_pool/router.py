"""The tokenizer pool's router: clients on one ROUTER socket, tokenizer
workers on another, jobs balanced between them.

Frontends (DEALER) send TokenizeJob / RenderChatJob / DetokenizeJob to the
frontend socket. Workers (DEALER, identity = their worker_id) announce
themselves with TokenizerReady, repeat it as a heartbeat, and answer each job
with a TokenizerReply. Any process that sends TokenizerReady joins the pool,
which is how remote workers (`pagedserve tokenizer --join`) add capacity.

A worker leaves when its process exits (the pool tells us, see pool.py), when
it has been silent for `liveness_timeout`, or when a send to it fails (its
connection is gone). Its in-flight jobs go back to the head of the queue.

The router never blocks on a peer: both sockets are ROUTER_MANDATORY and every
send is non-blocking, so an unreachable peer is noticed instead of stalling.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import msgspec
import zmq

from common.protocol import MessageType, TokenizerReady, TokenizerReply
from common.transport import BadFrame, MessageDecoder, bind_exclusive, encode, make_socket
from tokenizer_pool.balancer import Balancer, Job, PendingJob, QueueFull
from tokenizer_pool.pool_errors import POOL_ERROR_PREFIX, UNAVAILABLE_STATUS

logger = logging.getLogger(__name__)

JOB_TYPES = (MessageType.TOKENIZE, MessageType.RENDER_CHAT, MessageType.DETOKENIZE)
WORKER_TYPES = (MessageType.TOKENIZER_REPLY, MessageType.TOKENIZER_READY)
MAX_BATCH = 256  # messages read per wake-up from one socket, so neither starves the other


class Router:
    def __init__(self, ctx: zmq.Context, frontend_addr: str, backend_addr: str, *,
                 liveness_timeout: float = 5.0, capacity: int = 1, max_dispatches: int = 3,
                 max_queued: int = 4096):
        self.liveness_timeout = liveness_timeout
        self.balancer = Balancer(capacity=capacity, max_dispatches=max_dispatches, max_queued=max_queued)
        self.frontend = self._bind(ctx, frontend_addr)
        self.backend = self._bind(ctx, backend_addr)
        self._job_decoder = MessageDecoder(JOB_TYPES)
        self._worker_decoder = MessageDecoder(WORKER_TYPES)
        logger.info("tokenizer router: clients on %s, workers on %s",
                    self.frontend.getsockopt_string(zmq.LAST_ENDPOINT),
                    self.backend.getsockopt_string(zmq.LAST_ENDPOINT))

    @staticmethod
    def _bind(ctx: zmq.Context, addr: str) -> zmq.Socket:
        sock = make_socket(ctx, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of vanishing silently
        bind_exclusive(sock, addr)
        return sock

    def close(self) -> None:
        self.frontend.close(linger=0)
        self.backend.close(linger=0)

    # ---- event handling (called by the pool's poll loop) -------------------
    def on_frontend_readable(self) -> None:
        _drain(self.frontend, self._job_decoder, self._on_job)
        self._dispatch()

    def on_backend_readable(self) -> None:
        _drain(self.backend, self._worker_decoder, self._on_worker_message)
        self._dispatch()

    def remove_worker(self, worker_id: str, reason: str, *, charge: bool = True) -> None:
        if worker_id not in self.balancer.workers:
            return  # a local worker that never joined, or one already given up on
        requeued, given_up = self.balancer.remove_worker(worker_id, charge=charge)
        logger.warning("tokenizer worker %s left the pool (%s); re-dispatching %d job(s), %d workers remain",
                       worker_id, reason, len(requeued), len(self.balancer.workers))
        for pending in given_up:
            logger.error("giving up on tokenizer job %s: %d workers were lost while running it",
                         pending.job.job_id, pending.dispatches)
            self._reply(pending, TokenizerReply(
                job_id=pending.job.job_id,
                error=f"{POOL_ERROR_PREFIX}{pending.dispatches} tokenizer workers were lost while running this job",
                status=UNAVAILABLE_STATUS))
        self._dispatch()

    def check_liveness(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for worker_id in self.balancer.silent_workers(now, self.liveness_timeout):
            self.remove_worker(worker_id, f"silent for more than {self.liveness_timeout:g}s")

    def seconds_until_liveness_check(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        deadline = self.balancer.next_liveness_deadline(self.liveness_timeout)
        return None if deadline is None else max(0.0, deadline - now)

    # ---- internals ---------------------------------------------------------
    def _on_job(self, client: bytes, job: Job) -> None:
        try:
            self.balancer.submit(client, job)  # None for a resend of a pending job: nothing to do
        except QueueFull as e:
            logger.warning("rejecting tokenizer job %s: %s", job.job_id, e)
            self._send(self.frontend, client,
                       TokenizerReply(job_id=job.job_id, error=f"{POOL_ERROR_PREFIX}overloaded ({e})",
                                      status=UNAVAILABLE_STATUS))

    def _on_worker_message(self, identity: bytes, msg: TokenizerReady | TokenizerReply) -> None:
        now = time.monotonic()
        if isinstance(msg, TokenizerReady):
            if msg.leaving:
                self.remove_worker(msg.worker_id, "stopping", charge=False)
                return
            # heartbeats come from the worker's side socket, so trust the name, not the identity
            if self.balancer.worker_alive(msg.worker_id, now):
                logger.info("tokenizer worker %s joined the pool (%d workers)", msg.worker_id,
                            len(self.balancer.workers))
            return
        worker_id = identity.decode("utf-8", "replace")
        # a reply proves life but not membership: only TokenizerReady adds a worker
        self.balancer.worker_alive(worker_id, now, register=False)
        pending = self.balancer.finish(msg.job_id)
        if pending is None:
            logger.debug("ignoring a late or duplicate reply for job %s from %s", msg.job_id, worker_id)
            return
        self._reply(pending, msgspec.structs.replace(msg, job_id=pending.job.job_id))

    def _reply(self, pending: PendingJob, reply: TokenizerReply) -> None:
        self._send(self.frontend, pending.client, reply)

    def _dispatch(self) -> None:
        lost: list[str] = []
        for worker_id, pending in self.balancer.assignments(time.monotonic()):
            job = msgspec.structs.replace(pending.job, job_id=pending.key)
            if not self._send(self.backend, worker_id.encode(), job):
                self.balancer.undeliverable(pending)  # the job never left: a gone peer is not its fault
                lost.append(worker_id)
                break  # the balancer still counts this worker; remove it before dispatching more
        for worker_id in lost:
            self.remove_worker(worker_id, "unreachable")

    @staticmethod
    def _send(sock: zmq.Socket, peer: bytes, msg: msgspec.Struct) -> bool:
        try:
            sock.send_multipart([peer, *encode(msg)], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: peer gone; EAGAIN: peer not reading
            logger.debug("could not send %s to %r: %s", type(msg).__name__, peer, e)
            return False


def _drain(sock: zmq.Socket, decoder: MessageDecoder, handle: Callable[[bytes, msgspec.Struct], None]) -> None:
    """Handle up to MAX_BATCH waiting messages, dropping (and logging) bad frames."""
    for _ in range(MAX_BATCH):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        peer, body = frames[0], frames[1:]
        try:
            msg = decoder.decode(body)
        except BadFrame as e:
            logger.error("dropped a bad frame from %r: %s", peer, e)
            continue
        handle(peer, msg)
