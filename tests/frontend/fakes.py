"""Stand-ins for the scheduler process, for testing the frontend alone.

`FakeScheduler` binds a ROUTER like the real scheduler and speaks the same
protocol: each EngineRequest gets a scripted continuation, one output per
tick (finishing with STOP at the script's EOS, or LENGTH at max_tokens), each
of its samples (n > 1) the same one, an Abort ends a request (or one of its
samples) with an ABORT output, and too-long prompts get an
EngineError. A resubmitted request (`resumed`) carries on where each sample
was, its outputs tagged with its `attempt`. It records everything it receives so tests can check what the
frontend sent. `FakeControl` serves the scheduler's control gRPC service.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import zmq

from common.grpc_gen import control_pb2, control_pb2_grpc
from common.protocol import (Abort, EngineError, EngineOutputs, EngineRequest, FinishReason, FrontendHello,
                             MessageType, RequestOutput, TokenLogprobs, parent_request_id, sample_request_id)
from common.transport import MessageDecoder, make_socket, recv, send


SCRIPT_TEXT = " Hello, world! How are you today? The quick brown fox jumps over the lazy dog."


@dataclass
class _Running:
    request: EngineRequest
    peer: bytes
    script: list[int]
    interval: float
    index: int = 0  # the sample, when the request asks for several (n > 1)
    sent: int = 0
    next_time: float = 0.0


@dataclass
class Received:
    requests: list[EngineRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    hellos: list[tuple[bytes, FrontendHello]] = field(default_factory=list)


class FakeScheduler:
    """Scripts: every request continues with `script` then `eos_token_id`;
    a request whose prompt holds `slow_token` gets `slow_script` repeated
    forever at `slow_interval` s per token (to abort it mid-flight); one
    holding `reject_token` is rejected with an EngineError."""

    def __init__(self, address: str, script: list[int], eos_token_id: int, *, max_model_len: int = 10_000,
                 interval: float = 0.002, tokens_per_output: int = 1, slow_token: int | None = None,
                 slow_script: list[int] | None = None, slow_interval: float = 0.1,
                 reject_token: int | None = None):
        self.address = address
        self.script = script
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.interval = interval
        self.tokens_per_output = tokens_per_output
        self.slow_token, self.slow_script, self.slow_interval = slow_token, slow_script or [], slow_interval
        self.reject_token = reject_token
        self.received = Received()
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-scheduler", daemon=True)

    def start(self) -> "FakeScheduler":
        self._thread.start()
        assert self._ready.wait(5), "fake scheduler did not bind"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def snapshot(self) -> Received:
        with self._lock:
            return Received(list(self.received.requests), list(self.received.aborts), list(self.received.hellos))

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.snapshot()):
                return True
            time.sleep(0.01)
        return predicate(self.snapshot())

    # --- the loop (its own thread, its own socket) ---------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.ROUTER, bind=self.address)
        self._ready.set()
        decoder = MessageDecoder([MessageType.ENGINE_REQUEST, MessageType.ABORT, MessageType.FRONTEND_HELLO])
        try:
            while not self._stop.is_set():
                if sock.poll(1 if self._running else 20):
                    peer, msg = recv(sock, decoder, routed=True)
                    self._on_message(sock, peer, msg)
                self._emit(sock)
        finally:
            sock.close(linger=0)
            ctx.term()

    def _on_message(self, sock, peer: bytes, msg) -> None:
        with self._lock:
            if isinstance(msg, FrontendHello):
                self.received.hellos.append((peer, msg))
            elif isinstance(msg, Abort):
                self.received.aborts.extend(msg.request_ids)
            else:
                self.received.requests.append(msg)
        if isinstance(msg, Abort):
            for request_id in msg.request_ids:  # a request's id aborts all its samples
                for key in [k for k in self._running if request_id in (k, parent_request_id(k))]:
                    self._publish(sock, self._running.pop(key), [], FinishReason.ABORT)
            return
        if not isinstance(msg, EngineRequest):
            return
        prompt = msg.prompt_token_ids
        if len(prompt) > self.max_model_len or (self.reject_token is not None and self.reject_token in prompt):
            send(sock, EngineError(request_id=msg.request_id, attempt=msg.attempt, message=(
                f"prompt of {len(prompt)} tokens rejected (max_model_len {self.max_model_len})")), to=peer)
            return
        slow = self.slow_token is not None and self.slow_token in prompt
        script = list(self.slow_script) if slow else [*self.script, self.eos_token_id]
        interval = self.slow_interval if slow else self.interval
        num_samples = msg.sampling_params.num_samples
        resumed = {sample.index: sample for sample in msg.resumed}  # a resubmission carries on from there
        for index in range(num_samples):
            sample = resumed.get(index)
            if sample is not None and sample.finished:
                continue
            key = msg.request_id if num_samples == 1 else sample_request_id(msg.request_id, index)
            self._running[key] = _Running(msg, peer, script, interval, index,
                                          sent=len(sample.output_token_ids) if sample is not None else 0)

    def _emit(self, sock) -> None:
        now = time.monotonic()
        for request_id, running in list(self._running.items()):
            if now < running.next_time:
                continue
            running.next_time = now + running.interval
            params = running.request.sampling_params
            new_tokens, finish = [], None
            for _ in range(self.tokens_per_output):
                token = running.script[running.sent % len(running.script)]
                running.sent += 1
                new_tokens.append(token)
                stops = ([] if params.ignore_eos else [self.eos_token_id]) + list(params.stop_token_ids)
                if token in stops and running.sent > params.min_tokens:
                    finish = FinishReason.STOP
                elif params.max_tokens is not None and running.sent >= params.max_tokens:
                    finish = FinishReason.LENGTH
                if finish is not None:
                    break
            if finish is not None:
                del self._running[request_id]
            self._publish(sock, running, new_tokens, finish)

    def _publish(self, sock, running: _Running, tokens: list[int], finish: FinishReason | None) -> None:
        """Logprobs, when asked, are made up: -0.5 for each token, -1.0 for each prompt token."""
        prompt = running.request.prompt_token_ids
        params = running.request.sampling_params
        logprobs = prompt_logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprobs(t, -0.5, 1, [t][:params.logprobs], [-0.5][:params.logprobs]) for t in tokens]
        if params.prompt_logprobs is not None and not running.request.resumed and running.sent == len(tokens) \
                and running.index == 0:
            prompt_logprobs = [TokenLogprobs(t, -1.0, 1) for t in prompt[1:]]  # with the first output
        request_id = running.request.request_id
        more_samples = any(other.request.request_id == request_id for other in self._running.values())
        output = RequestOutput(request_id=request_id, new_token_ids=tokens, finish_reason=finish,
                               num_prompt_tokens=len(prompt), num_cached_tokens=len(prompt) // 2, index=running.index,
                               more_samples=more_samples, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                               attempt=running.request.attempt)
        send(sock, EngineOutputs(outputs=[output], timestamp=time.time()), to=running.peer)


STATS = control_pb2.SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                                   prefix_cache_hits=40, num_preemptions=1, num_prompt_tokens=500,
                                   num_generation_tokens=700, num_free_blocks=30, num_blocks=40)


class FakeControl(control_pb2_grpc.SchedulerControlServicer):
    def __init__(self, max_model_len: int, vocab_size: int, max_logprobs: int | None = None):
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs  # None: an older scheduler, which does not say
        self.healthy = True
        self._server: grpc.Server | None = None

    def Health(self, request, context):
        return control_pb2.HealthReply(ok=self.healthy, worker_ready=self.healthy,
                                       message="ready" if self.healthy else "no worker")

    def GetModelInfo(self, request, context):
        return control_pb2.ModelInfo(model="fake", max_model_len=self.max_model_len, block_size=16,
                                     num_blocks=40, vocab_size=self.vocab_size, dtype="float32",
                                     max_logprobs=self.max_logprobs)

    def GetStats(self, request, context):
        return STATS

    def start(self, address: str, credentials: grpc.ServerCredentials | None = None) -> "FakeControl":
        """Serve on `address`, over TLS with `credentials`."""
        self.address = address
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        control_pb2_grpc.add_SchedulerControlServicer_to_server(self, self._server)
        port = (self._server.add_insecure_port(address) if credentials is None
                else self._server.add_secure_port(address, credentials))
        assert port != 0
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
