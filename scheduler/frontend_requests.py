"""The scheduler's side of its frontends: whose request is whose, and what each frontend is told.

The engine loop (scheduler_service.py) hands every frontend message here and
every step's outputs; this module keeps the per-frontend bookkeeping that
goes with them, so that the loop itself only deals with workers and steps:
- which frontend owns each request (and the attempt it sent, echoed in errors),
  so each frontend gets only the outputs of its own requests, batched per step;
- requests that arrived before any worker registered;
- when each frontend was last heard from: one that disconnects or falls silent
  has its requests aborted and their KV blocks freed;
- the waiting-queue limit: new requests over it get status 429, and every
  frontend is told when the queue fills or drains.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Callable

import zmq

from common.errors import InvalidRequestError
from common.protocol import (Abort, EngineError, EngineOutputs, EngineRequest, FrontendHello, RequestOutput,
                             PROTOCOL_VERSION)
from common.transport import send
from scheduler.connections import PeerTracker
from scheduler.scheduler import Scheduler
from scheduler.worker_registry import CrashLedger, peer_name as _name

logger = logging.getLogger(__name__)

OVERLOADED_STATUS = 429


class FrontendRequests:
    """Every frontend's requests and liveness, over the frontends' ROUTER socket.

    `scheduler` returns the Scheduler, or None until the first worker
    registers (the service creates it then, with the worker's KV cache shape).
    `crashes` is shared with the service, which charges worker deaths to
    requests; a request that leaves (finished, or its frontend gone) is
    forgotten there too.
    """

    def __init__(self, socket: zmq.Socket, peers: PeerTracker, scheduler: Callable[[], Scheduler | None],
                 crashes: CrashLedger, *, timeout_s: float, max_waiting_requests: int | None):
        self.socket = socket
        self.peers = peers
        self._scheduler = scheduler
        self.crashes = crashes
        self.timeout_s = timeout_s
        self.max_waiting_requests = max_waiting_requests
        self.pending: list[tuple[bytes, EngineRequest]] = []  # arrived before any worker registered
        self.owner: dict[str, bytes] = {}  # request id -> frontend identity
        self.attempt: dict[str, int] = {}  # request id -> its EngineRequest.attempt (echoed in errors)
        self.seen: dict[bytes, float] = {}  # frontend identity -> when last heard from (monotonic)
        self.queue_full = False  # what the frontends were last told

    # --- messages from frontends --------------------------------------------------
    def on_message(self, peer: bytes, msg) -> None:
        is_new = peer not in self.seen
        self.seen[peer] = time.monotonic()
        if is_new:
            logger.info("frontend %s connected", _name(peer))
            if self.queue_full:
                send(self.socket, EngineOutputs(outputs=[], timestamp=time.time(), queue_full=True), to=peer)
        if isinstance(msg, EngineRequest):
            if self.queue_is_full() and msg.attempt == 0:  # a resubmission was accepted once already
                send(self.socket, EngineError(
                    request_id=msg.request_id, status=OVERLOADED_STATUS, attempt=msg.attempt,
                    message=f"The server is overloaded: {self.num_waiting()} requests are waiting already "
                            f"(max_waiting_requests={self.max_waiting_requests}); retry later"), to=peer)
            elif self._scheduler() is None:
                self.pending.append((peer, msg))
            else:
                self._add(peer, msg)
        elif isinstance(msg, Abort):
            self._on_abort(peer, msg.request_ids)
        elif isinstance(msg, FrontendHello):
            if msg.protocol_version != PROTOCOL_VERSION:
                logger.error("frontend %r speaks protocol %d, we speak %d", peer, msg.protocol_version,
                             PROTOCOL_VERSION)

    def admit_pending(self) -> None:
        """Hand the scheduler the requests that waited for a worker to register."""
        for frontend, req in self.pending:
            self._add(frontend, req)
        self.pending.clear()

    def _add(self, peer: bytes, req: EngineRequest) -> None:
        if req.request_id in self.owner:
            send(self.socket, EngineError(request_id=req.request_id, attempt=req.attempt, message=(
                f"request id {req.request_id!r} is already in flight")), to=peer)
            return
        try:
            self._scheduler().add_request(req)  # which validates the sampling params
        except InvalidRequestError as e:
            send(self.socket, EngineError(request_id=req.request_id, message=e.message, attempt=req.attempt),
                 to=peer)
            return
        self.owner[req.request_id] = peer
        self.attempt[req.request_id] = req.attempt

    def _on_abort(self, peer: bytes, request_ids: list[str]) -> None:
        """Abort what this frontend asked for: its requests, or samples of them (n > 1)."""
        dropped = set(request_ids)
        self.pending = [(owner, req) for owner, req in self.pending
                        if owner != peer or req.request_id not in dropped]
        scheduler = self._scheduler()
        if scheduler is not None:
            self.abort([rid for rid in request_ids if self.owner.get(scheduler.client_request_id(rid)) == peer])

    # --- requests leaving ---------------------------------------------------------
    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (or samples) and tell their frontends."""
        scheduler = self._scheduler()
        if request_ids and scheduler is not None:
            self.publish(scheduler.abort_requests(request_ids))

    def fail(self, request_id: str, status: int, message: str) -> None:
        """Send the owner of this (still owned) request an error; the caller aborts it."""
        send(self.socket, EngineError(request_id=request_id, status=status, attempt=self.attempt.get(request_id, 0),
                                      message=message), to=self.owner[request_id])

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Send each frontend the outputs of its own requests, one message per frontend."""
        by_frontend: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for out in outputs:
            peer = self.owner.get(out.request_id)
            if peer is None:
                continue
            by_frontend[peer].append(out)
            if out.request_finished:  # (with n > 1, a sample's finish is not the request's)
                del self.owner[out.request_id]
                self.attempt.pop(out.request_id, None)
                self.crashes.forget(out.request_id)
        now = time.time()
        for peer, outs in by_frontend.items():
            send(self.socket, EngineOutputs(outputs=outs, timestamp=now, queue_full=self.queue_full), to=peer)

    # --- frontends leaving --------------------------------------------------------
    def gone(self, peer: bytes, reason: str, *, still_connected: bool = False) -> None:
        """Abort everything the frontend asked for: nobody is left to read it. One
        that only fell silent is told which requests were dropped, so that if it is
        alive after all it resubmits them instead of waiting for them forever."""
        self.seen.pop(peer, None)
        self.peers.forget(peer)
        dropped = {req.request_id: req.attempt for owner, req in self.pending if owner == peer}
        self.pending = [(owner, req) for owner, req in self.pending if owner != peer]
        orphans = [rid for rid, owner in self.owner.items() if owner == peer]
        for rid in orphans:  # their abort outputs go nowhere: a frontend told of `dropped` resubmits
            del self.owner[rid]
            dropped[rid] = self.attempt.pop(rid, 0)
            self.crashes.forget(rid)
        if orphans:
            logger.warning("frontend %s %s: aborting its %d requests", _name(peer), reason, len(orphans))
            scheduler = self._scheduler()
            if scheduler is not None:
                scheduler.abort_requests(orphans)
        else:
            logger.info("frontend %s %s", _name(peer), reason)
        if still_connected and dropped:
            send(self.socket, EngineOutputs(outputs=[], timestamp=time.time(), queue_full=self.queue_full,
                                            dropped=dropped), to=peer)

    def expire_silent(self) -> None:
        """Treat a frontend heard nothing from (not even a heartbeat) for `timeout_s` as gone."""
        now = time.monotonic()
        for peer, seen in list(self.seen.items()):
            if now - seen > self.timeout_s:
                self.gone(peer, f"silent for {now - seen:.0f}s", still_connected=True)

    # --- the waiting-queue limit --------------------------------------------------
    def num_waiting(self) -> int:
        scheduler = self._scheduler()
        return len(self.pending) + (len(scheduler.waiting) if scheduler is not None else 0)

    def queue_is_full(self) -> bool:
        return self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests

    def announce_queue_state(self) -> None:
        """Tell every frontend when the queue fills or drains, so they answer
        429 before starting a response instead of after."""
        full = self.queue_is_full()
        if full == self.queue_full:
            return
        self.queue_full = full
        if full:
            logger.warning("waiting queue full (%d requests): new requests get 429 until it drains",
                           self.num_waiting())
        else:
            logger.info("waiting queue below its limit again: accepting new requests")
        message = EngineOutputs(outputs=[], timestamp=time.time(), queue_full=full)
        for peer in self.seen:
            send(self.socket, message, to=peer)
