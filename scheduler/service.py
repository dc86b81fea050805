"""The scheduler process: owns the Scheduler, talks ZeroMQ to frontends and workers.

One thread runs the engine loop: it blocks in zmq poll while idle (no busy
spinning: every idle cycle on a 2-core machine is stolen from the model),
takes requests and aborts from any number of frontends, sends each step's
plan to the worker, applies the result and sends every frontend the outputs
of its own requests, batched per step. The gRPC control service reads a
snapshot the loop publishes and hands state changes to the loop.
"""
from __future__ import annotations

import logging
import queue
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import asdict

import zmq

from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.protocol import (Abort, EngineError, EngineOutputs, EngineRequest, FrontendHello, MessageType,
                             RequestOutput, StepPlan, StepResult, WorkerHello, WorkerReady, PROTOCOL_VERSION)
from common.transport import MessageDecoder, make_socket, recv, send
from scheduler.control import ControlSnapshot, ControlState
from scheduler.scheduler import Scheduler
from scheduler.stats_logger import StatsLogger

logger = logging.getLogger(__name__)

FRONTEND_TYPES = (MessageType.ENGINE_REQUEST, MessageType.ABORT, MessageType.FRONTEND_HELLO)
WORKER_TYPES = (MessageType.WORKER_HELLO, MessageType.STEP_RESULT)
IDLE_POLL_MS = 1000


class SchedulerService:
    def __init__(self, config: EngineConfig, frontend_address: str, worker_address: str,
                 control: ControlState, *, frontend_timeout_s: float = 5.0, log_stats: bool = True):
        self.config = config
        self.control = control
        self.frontend_timeout_s = frontend_timeout_s
        self.ctx = zmq.Context.instance()
        self.frontends = make_socket(self.ctx, zmq.ROUTER, bind=frontend_address)
        self.workers = make_socket(self.ctx, zmq.ROUTER, bind=worker_address)
        self.wakeup = make_socket(self.ctx, zmq.PULL, bind=f"inproc://scheduler-wakeup-{id(self)}")
        self._wakeup_address = f"inproc://scheduler-wakeup-{id(self)}"
        self.commands: queue.Queue[tuple[str, Future]] = queue.Queue()
        self.frontend_decoder = MessageDecoder(FRONTEND_TYPES)
        self.worker_decoder = MessageDecoder(WORKER_TYPES)
        self.scheduler: Scheduler | None = None
        self.worker_identity: bytes | None = None
        self.worker_hello: WorkerHello | None = None
        self.pending: list[tuple[bytes, EngineRequest]] = []  # arrived before any worker registered
        self.owner: dict[str, bytes] = {}  # request id -> frontend identity
        self.frontend_seen: dict[bytes, float] = {}
        self.step_in_flight: StepPlan | None = None
        self.stats_logger = StatsLogger(enabled=log_stats)
        self.scheduler_id = uuid.uuid4().hex
        self.running = True

    # --- called from other threads ------------------------------------------
    def request_reset_prefix_cache(self) -> Future:
        future: Future = Future()
        self.commands.put(("reset_prefix_cache", future))
        sock = self.ctx.socket(zmq.PUSH)  # one per call: zmq sockets are not thread-safe
        try:
            sock.connect(self._wakeup_address)
            sock.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the loop has a wakeup pending already
        finally:
            sock.close(linger=0)
        return future

    # --- the engine loop --------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.frontends, self.workers, self.wakeup):
            poller.register(sock, zmq.POLLIN)
        while self.running:
            self.control.loop_heartbeat = time.monotonic()
            ready_to_step = self._ready_to_step()
            events = dict(poller.poll(0 if ready_to_step else IDLE_POLL_MS))
            if self.frontends in events:
                self._drain(self.frontends, self.frontend_decoder, self._on_frontend_message)
            if self.workers in events:
                self._drain(self.workers, self.worker_decoder, self._on_worker_message)
            if self.wakeup in events:
                self._drain_commands()
            self._expire_silent_frontends()
            if self._ready_to_step():
                self._start_step()
            self.stats_logger.maybe_log(self.scheduler)

    def close(self) -> None:
        self.running = False
        for sock in (self.frontends, self.workers, self.wakeup):
            sock.close(linger=0)

    def _ready_to_step(self) -> bool:
        return (self.scheduler is not None and self.step_in_flight is None
                and self.scheduler.has_unfinished_requests())

    @staticmethod
    def _drain(sock: zmq.Socket, decoder: MessageDecoder, handler, limit: int = 1024) -> None:
        for _ in range(limit):
            try:
                peer, msg = recv(sock, decoder, routed=True, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handler(peer, msg)
            except Exception:  # one bad message must never take the scheduler down
                logger.exception("error while handling %s from %r", type(msg).__name__, peer)

    # --- frontends ----------------------------------------------------------------
    def _on_frontend_message(self, peer: bytes, msg) -> None:
        self.frontend_seen[peer] = time.monotonic()
        if isinstance(msg, EngineRequest):
            if self.scheduler is None:
                self.pending.append((peer, msg))
            else:
                self._add_request(peer, msg)
        elif isinstance(msg, Abort):
            self._abort([rid for rid in msg.request_ids if self.owner.get(rid) == peer])
        elif isinstance(msg, FrontendHello):
            if msg.protocol_version != PROTOCOL_VERSION:
                logger.error("frontend %r speaks protocol %d, we speak %d", peer, msg.protocol_version,
                             PROTOCOL_VERSION)

    def _add_request(self, peer: bytes, req: EngineRequest) -> None:
        if req.request_id in self.owner:
            send(self.frontends, EngineError(request_id=req.request_id, message=(
                f"request id {req.request_id!r} is already in flight")), to=peer)
            return
        try:
            req.sampling_params.validate()
            self.scheduler.add_request(req)
        except InvalidRequestError as e:
            send(self.frontends, EngineError(request_id=req.request_id, message=e.message), to=peer)
            return
        self.owner[req.request_id] = peer

    def _abort(self, request_ids: list[str]) -> None:
        if request_ids and self.scheduler is not None:
            self._publish_outputs(self.scheduler.abort_requests(request_ids))

    def _expire_silent_frontends(self) -> None:
        now = time.monotonic()
        for peer, seen in list(self.frontend_seen.items()):
            if now - seen <= self.frontend_timeout_s:
                continue
            del self.frontend_seen[peer]
            orphans = [rid for rid, owner in self.owner.items() if owner == peer]
            if orphans:
                logger.warning("frontend %r silent for %.0fs: aborting its %d requests", peer,
                               now - seen, len(orphans))
                self._abort(orphans)

    def _publish_outputs(self, outputs: list[RequestOutput]) -> None:
        by_frontend: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for out in outputs:
            peer = self.owner.get(out.request_id)
            if peer is None:
                continue
            by_frontend[peer].append(out)
            if out.finish_reason is not None:
                del self.owner[out.request_id]
        now = time.time()
        for peer, outs in by_frontend.items():
            send(self.frontends, EngineOutputs(outputs=outs, timestamp=now), to=peer)

    # --- workers ------------------------------------------------------------------
    def _on_worker_message(self, peer: bytes, msg) -> None:
        if isinstance(msg, WorkerHello):
            self._on_worker_hello(peer, msg)
        elif isinstance(msg, StepResult):
            plan = self.step_in_flight
            if plan is None or peer != self.worker_identity or msg.step_id != plan.step_id:
                logger.warning("ignoring a stale step result (step %d) from %r", msg.step_id, peer)
                return
            self.step_in_flight = None
            outputs = self.scheduler.update(plan, msg)
            self._publish_outputs(outputs)
            self.stats_logger.record_step(plan, outputs)
            self._publish_snapshot()

    def _on_worker_hello(self, peer: bytes, hello: WorkerHello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            send(self.workers, WorkerReady(accepted=False, message="protocol version mismatch"), to=peer)
            return
        if self.scheduler is not None:
            # A second worker for the same replica (tensor parallel) is not supported yet.
            if peer != self.worker_identity:
                send(self.workers, WorkerReady(accepted=False, message="a worker is already registered"), to=peer)
                return
            logger.debug("worker %r said hello again", peer)
            send(self.workers, WorkerReady(accepted=True, scheduler_id=self.scheduler_id), to=peer)
            return
        self.scheduler = Scheduler(self.config, num_blocks=hello.num_blocks, max_model_len=hello.max_model_len,
                                   eos_token_ids=list(hello.eos_token_ids))
        self.worker_identity, self.worker_hello = peer, hello
        logger.info("worker %r registered: %s, %d KV blocks of %d tokens, max_model_len %d", peer,
                    hello.model_name, hello.num_blocks, hello.block_size, hello.max_model_len)
        send(self.workers, WorkerReady(accepted=True, scheduler_id=self.scheduler_id), to=peer)
        for frontend, req in self.pending:
            self._add_request(frontend, req)
        self.pending.clear()
        self._publish_snapshot()

    def _start_step(self) -> None:
        plan = self.scheduler.schedule()
        if plan is None:
            return
        send(self.workers, plan, to=self.worker_identity)
        self.step_in_flight = plan

    # --- control -----------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                self.wakeup.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while not self.commands.empty():
            name, future = self.commands.get_nowait()
            if name == "reset_prefix_cache":
                future.set_result(self.scheduler.reset_prefix_cache() if self.scheduler else False)

    def _publish_snapshot(self) -> None:
        stats = asdict(self.scheduler.stats()) if self.scheduler else {}
        if self.worker_hello:
            stats["num_blocks"] = self.worker_hello.num_blocks
        self.control.publish(ControlSnapshot(worker=self.worker_hello, stats=stats))
