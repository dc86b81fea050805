"""The scheduler process: owns the Scheduler, talks ZeroMQ to frontends and workers.

One thread runs the engine loop: it blocks in zmq poll while idle (no busy
spinning: every idle cycle on a 2-core machine is stolen from the model),
takes requests and aborts from any number of frontends, sends each step's
plan to the worker, applies the result and sends every frontend the outputs
of its own requests, batched per step. The per-frontend bookkeeping (who
owns which request, frontend liveness, the waiting-queue limit) lives in
frontend_requests.py; this module keeps the loop, the workers and the
steps. The gRPC control service reads a snapshot the loop publishes and
hands state changes to the loop.

Failures it survives (see docs/operations.md):
- a worker whose connection closes (process died), goes silent (ZMTP
  heartbeats) or, with `worker_step_timeout_s`, takes longer than that for a
  step (hung): its running requests go back to the waiting queue with their
  tokens, the prefix cache is cleared, and the next worker to say hello
  takes over and recomputes them; clients only see a pause;
- a frontend that disconnects or stops its heartbeat: its requests are
  aborted and their KV blocks freed;
- too many waiting requests (`max_waiting_requests`): new ones are refused
  with status 429, and every frontend is told while the queue is full;
- a request that was in the step of two worker deaths: it is failed (status
  500) instead of being handed to the next worker;
- a request the worker could not run (an unusable LoRA adapter, StepResult.failed):
  it is failed (status 400) and aborted; the rest of the step is applied.
"""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict

import zmq

from common.config import EngineConfig
from common.protocol import MessageType, StepPlan, StepResult, WorkerGoodbye, WorkerHello, WorkerReady
from common.transport import MessageDecoder, bind_exclusive, make_socket, send
from scheduler.command_inbox import CommandInbox
from scheduler.connections import PeerTracker, enable_heartbeats
from scheduler.control import ControlSnapshot, ControlState
from scheduler.frontend_requests import FrontendRequests
from scheduler.scheduler import Scheduler
from scheduler.stats_logger import StatsLogger
from scheduler.worker_registry import CrashLedger, Verdict, WorkerRegistry, peer_name as _name

logger = logging.getLogger(__name__)

FRONTEND_TYPES = (MessageType.ENGINE_REQUEST, MessageType.ABORT, MessageType.FRONTEND_HELLO)
WORKER_TYPES = (MessageType.WORKER_HELLO, MessageType.STEP_RESULT, MessageType.WORKER_GOODBYE)
IDLE_POLL_MS = 1000


class SchedulerService:
    def __init__(self, config: EngineConfig, frontend_address: str, worker_address: str,
                 control: ControlState, *, frontend_timeout_s: float = 5.0, log_stats: bool = True,
                 max_waiting_requests: int | None = None, worker_step_timeout_s: float | None = None):
        self.config = config
        self.control = control
        self.worker_step_timeout_s = worker_step_timeout_s
        self.ctx = zmq.Context.instance()
        self.frontends = make_socket(self.ctx, zmq.ROUTER)
        enable_heartbeats(self.frontends)
        bind_exclusive(self.frontends, frontend_address)
        self.workers = make_socket(self.ctx, zmq.ROUTER)
        enable_heartbeats(self.workers)
        self.workers.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a plan sent to a vanished worker raises
        bind_exclusive(self.workers, worker_address)
        self.frontend_peers = PeerTracker(self.frontends)
        self.worker_peers = PeerTracker(self.workers)
        self.inbox = CommandInbox(self.ctx)  # from the gRPC control service's threads
        self.frontend_decoder = MessageDecoder(FRONTEND_TYPES)
        self.worker_decoder = MessageDecoder(WORKER_TYPES)
        self.scheduler: Scheduler | None = None
        self.scheduler_id = uuid.uuid4().hex
        self.registry = WorkerRegistry(self.scheduler_id)
        self.step_in_flight: StepPlan | None = None
        self.step_sent_at = 0.0
        self.crashes = CrashLedger(limit=2)  # a request in the step of two worker deaths is failed
        self.frontend_requests = FrontendRequests(  # who owns which request; liveness; the queue limit
            self.frontends, self.frontend_peers, lambda: self.scheduler, self.crashes,
            timeout_s=frontend_timeout_s, max_waiting_requests=max_waiting_requests)
        self.stats_logger = StatsLogger(enabled=log_stats)
        self.running = True

    # --- called from other threads ------------------------------------------
    def request_reset_prefix_cache(self) -> Future:
        return self.inbox.submit("reset_prefix_cache")

    # --- the engine loop --------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.frontends, self.workers, self.inbox.socket, self.frontend_peers.monitor,
                     self.worker_peers.monitor):
            poller.register(sock, zmq.POLLIN)
        while self.running:
            self.control.loop_heartbeat = time.monotonic()
            events = dict(poller.poll(0 if self._ready_to_step() else IDLE_POLL_MS))
            # Messages first: a result sent just before a worker died still counts.
            if self.frontends in events:
                self._drain(self.frontend_peers, self.frontend_decoder, self.frontend_requests.on_message)
            if self.workers in events:
                self._drain(self.worker_peers, self.worker_decoder, self._on_worker_message)
            if self.worker_peers.monitor in events:
                for peer in self.worker_peers.disconnected_peers():
                    self.registry.standby.pop(peer, None)
                    if peer == self.registry.identity:
                        self._on_worker_lost("its connection closed")
            if self.frontend_peers.monitor in events:
                for peer in self.frontend_peers.disconnected_peers():
                    self.frontend_requests.gone(peer, "disconnected")
            if self.inbox.socket in events:
                self._drain_commands()
            self.frontend_requests.expire_silent()
            self._check_step_timeout()
            if self._ready_to_step():
                self._start_step()
            self.frontend_requests.announce_queue_state()
            self._publish_snapshot()
            self.stats_logger.maybe_log(self.scheduler)

    def close(self) -> None:
        self.running = False
        self.frontend_peers.close()
        self.worker_peers.close()
        for sock in (self.frontends, self.workers):
            sock.close(linger=0)
        self.inbox.close()

    def _ready_to_step(self) -> bool:
        return (self.registry.identity is not None and self.step_in_flight is None
                and self.scheduler.has_unfinished_requests())

    @staticmethod
    def _drain(peers: PeerTracker, decoder: MessageDecoder, handler, limit: int = 1024) -> None:
        for _ in range(limit):
            try:
                received = peers.recv(decoder)
            except zmq.Again:
                return
            if received is None:
                continue
            peer, msg = received
            try:
                handler(peer, msg)
            except Exception:  # one bad message must never take the scheduler down
                logger.exception("error while handling %s from %r", type(msg).__name__, peer)

    # --- workers ------------------------------------------------------------------
    def _on_worker_message(self, peer: bytes, msg) -> None:
        if isinstance(msg, WorkerHello):
            self._on_worker_hello(peer, msg)
        elif isinstance(msg, StepResult):
            plan = self.step_in_flight
            if plan is None or peer != self.registry.identity or msg.step_id != plan.step_id:
                logger.warning("ignoring a stale step result (step %d) from %s", msg.step_id, _name(peer))
                return
            self.step_in_flight = None
            if msg.failed:
                self._fail_unrunnable(msg.failed)
            outputs = self.scheduler.update(plan, msg)
            self.frontend_requests.publish(outputs)
            self.stats_logger.record_step(plan, outputs)
        elif isinstance(msg, WorkerGoodbye):
            if peer == self.registry.identity:
                self._on_worker_lost(f"it is stopping: {msg.reason}", crashed=False)
            elif self.registry.standby.pop(peer, None) is not None:
                logger.info("standby worker %s stopped: %s", _name(peer), msg.reason)

    def _reply_worker(self, peer: bytes, reply: WorkerReady) -> bool:
        try:
            send(self.workers, reply, to=peer)
            return True
        except zmq.ZMQError as e:  # gone again already
            logger.warning("cannot answer worker %s: %s", _name(peer), e)
            return False

    def _on_worker_hello(self, peer: bytes, hello: WorkerHello) -> None:
        has_requests = self.scheduler is not None and self.scheduler.has_unfinished_requests()
        decision = self.registry.judge(peer, hello, has_requests)
        if decision.verdict is Verdict.SAME:
            self._reply_worker(peer, WorkerReady(accepted=True, scheduler_id=self.registry.session_id))
            return
        if decision.verdict in (Verdict.STANDBY, Verdict.REFUSED):
            standby = decision.verdict is Verdict.STANDBY
            if not standby:
                self.registry.standby.pop(peer, None)
                logger.error("refusing worker %s: %s", _name(peer), decision.message)
            elif peer not in self.registry.standby:
                self.registry.standby[peer] = hello
                logger.warning("worker %s stands by: %s", _name(peer), decision.message)
            self._reply_worker(peer, WorkerReady(accepted=False, standby=standby, message=decision.message))
            return
        if decision.verdict is Verdict.REPLACEMENT:
            self.scheduler.reset_prefix_cache_for_new_worker()  # its KV cache holds nothing of ours
            logger.warning("worker %s registered and replaces the lost worker: resuming %d requests", _name(peer),
                           len(self.scheduler.waiting))
        else:
            config = self.config
            if hello.block_size != config.block_size:  # the worker owns the KV cache: its blocks count
                logger.warning("worker %s has KV blocks of %d tokens, not the %d configured here: using %d",
                               _name(peer), hello.block_size, config.block_size, hello.block_size)
                config = config.replace(block_size=hello.block_size)
            self.scheduler = Scheduler(config, num_blocks=hello.num_blocks, max_model_len=hello.max_model_len,
                                       eos_token_ids=list(hello.eos_token_ids), vocab_size=hello.vocab_size or None,
                                       sliding_window=hello.sliding_window, pooler=hello.pooler)
            logger.info("worker %s registered: %s, %d KV blocks of %d tokens, max_model_len %d", _name(peer),
                        hello.model_name, hello.num_blocks, hello.block_size, hello.max_model_len)
        self.registry.register(peer, hello)
        if not self._reply_worker(peer, WorkerReady(accepted=True, scheduler_id=self.registry.session_id)):
            self._on_worker_lost("unreachable right after its hello")
            return
        self.frontend_requests.admit_pending()

    def _on_worker_lost(self, reason: str, crashed: bool = True) -> None:
        """Keep every request: back to waiting with its tokens, recomputed by the next worker.
        Only a crash (not a worker stopping on purpose) counts against the lost step's requests."""
        peer = self.registry.lose()
        self.worker_peers.forget(peer)
        plan, self.step_in_flight = self.step_in_flight, None  # its result will never come
        moved = self.scheduler.requeue_running()
        self.scheduler.reset_prefix_cache_for_new_worker()
        logger.log(logging.ERROR if crashed else logging.WARNING,
                   "worker %s lost (%s): %d running requests moved back to the waiting queue with their "
                   "tokens; %d requests wait for a worker to register", _name(peer), reason, moved,
                   len(self.scheduler.waiting))
        if plan is not None and crashed:
            self._fail_suspects(list(plan.num_scheduled_tokens))
        for standby, hello in list(self.registry.standby.items()):
            self._on_worker_hello(standby, hello)  # the longest-waiting standby worker takes over at once
            if self.registry.identity is not None:
                break

    def _fail_suspects(self, request_ids: list[str]) -> None:
        """Charge a worker death to every request of the lost step; fail the
        ones charged twice rather than feed them to the next worker."""
        charged = self.crashes.charge([self.scheduler.client_request_id(rid) for rid in request_ids])
        suspects = [rid for rid in charged if rid in self.frontend_requests.owner]
        for request_id in suspects:
            deaths = self.crashes.deaths[request_id]
            logger.error("request %s was running when %d workers died: failing it", request_id, deaths)
            self.frontend_requests.fail(request_id, 500, (
                f"the model worker died {deaths} times while running this request; it was failed so that it "
                f"cannot take down the next one"))
        self.frontend_requests.abort(suspects)

    def _fail_unrunnable(self, failed: dict[str, str]) -> None:
        """Requests the worker could not run (their LoRA adapter does not fit the model, or its
        files changed): each fails with a 400 and is aborted, its KV blocks freed; the rest of
        the step's results apply as usual."""
        reasons: dict[str, str] = {}
        for request_id, reason in failed.items():
            reasons.setdefault(self.scheduler.client_request_id(request_id), reason)
        for request_id, reason in reasons.items():
            logger.warning("request %s failed: %s", request_id, reason)
            if request_id in self.frontend_requests.owner:
                self.frontend_requests.fail(request_id, 400, reason)
        self.frontend_requests.abort(list(reasons))

    def _start_step(self) -> None:
        plan = self.scheduler.schedule()
        if plan is None:
            return
        try:
            send(self.workers, plan, to=self.registry.identity)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the worker's connection is gone
            self._on_worker_lost(f"unreachable: {e}")
            return
        self.step_in_flight = plan
        self.step_sent_at = time.monotonic()

    def _check_step_timeout(self) -> None:
        """A worker that is alive (its connection and heartbeats are fine) but
        returns no result is hung: treat it as lost (off unless configured)."""
        if self.step_in_flight is None or not self.worker_step_timeout_s:
            return
        waited = time.monotonic() - self.step_sent_at
        if waited > self.worker_step_timeout_s:
            self._on_worker_lost(f"no result for step {self.step_in_flight.step_id} after {waited:.0f}s")

    # --- control -----------------------------------------------------------------
    def _drain_commands(self) -> None:
        for name, future in self.inbox.take():
            if name == "reset_prefix_cache":
                future.set_result(self.scheduler.reset_prefix_cache() if self.scheduler else False)

    def _publish_snapshot(self) -> None:
        stats = asdict(self.scheduler.stats()) if self.scheduler else {}
        hello, ready = self.registry.hello, self.registry.identity is not None
        if hello:
            stats["num_blocks"] = hello.num_blocks
        if ready:
            status = "ready"
        elif hello is not None:
            status = f"waiting for a worker to replace the lost one ({len(self.scheduler.waiting)} requests paused)"
        else:
            status = "waiting for a worker"
        self.control.publish(ControlSnapshot(worker=hello, worker_ready=ready, status=status, stats=stats))

