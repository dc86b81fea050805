"""The frontend's asyncio client to the scheduler (ZMQ DEALER -> scheduler ROUTER).

One receive task routes every `RequestOutput` to the queue of its request; a
send task owns all writes to the socket. The frontend says `FrontendHello`
on every (re)connection and once a second as its heartbeat.

A lost scheduler loses no request: when the connection drops (a scheduler
killed or restarted; ZMTP heartbeats notice a vanished host too) every
in-flight request waits, and once a scheduler is connected again each is
resubmitted with the tokens it had produced (`RequestStream.resubmission`),
so clients only see a pause. The same when the scheduler says it dropped this
frontend's requests (it thought the frontend gone). Only when no scheduler
is back within `restart_timeout` seconds do they fail with
`ServiceUnavailableError` (HTTP 503); new requests wait `connect_grace`
seconds for one. A scheduler that is connected but silent for
`stall_timeout` seconds while the health probe (its control service) says it
is not healthy fails its requests: a hung one would not run them either.
Nothing is queued in ZeroMQ for a scheduler that is not there
(ZMQ_IMMEDIATE): resubmission is the one way a request reaches a new one.

Overload: while the scheduler reports its waiting queue full, requests are
refused up front (`ensure_connected` raises OverloadedError, HTTP 429) before
any response starts; one that slips through is refused by the scheduler
itself. An optional `request_timeout` bounds each request end to end.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import AsyncIterator, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.errors import InvalidRequestError
from common.protocol import (Abort, EngineError, EngineOutputs, EngineRequest, FrontendHello, ImageInput, MessageType,
                             RequestOutput, parent_request_id, sample_request_id)
from common.lora_request import LoRARequest
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from common.transport import MessageDecoder, arecv, encode, make_socket
from frontend.api_errors import OverloadedError, RequestTimeoutError, ServiceUnavailableError, error_with_status
from frontend.engine.request_stream import RequestStream

logger = logging.getLogger(__name__)

HealthProbe = Callable[[], Awaitable[bool]]
MAX_RESUBMISSIONS = 5  # a request whose scheduler is lost more often than this fails with 503


def new_frontend_id() -> str:
    return f"frontend-{os.getpid()}-{secrets.token_hex(4)}"


class EngineClient:
    def __init__(self, scheduler_address: str, *, frontend_id: str | None = None,
                 health_probe: HealthProbe | None = None, heartbeat_interval: float = 1.0,
                 stall_timeout: float = 10.0, connect_grace: float = 1.0, request_timeout: float | None = None,
                 restart_timeout: float = 60.0, on_resubmit: Callable[[int], None] | None = None):
        self.scheduler_address = scheduler_address
        self.frontend_id = frontend_id or new_frontend_id()
        self._health_probe = health_probe
        self._heartbeat_interval = heartbeat_interval
        self._stall_timeout = stall_timeout
        self._connect_grace = connect_grace
        self._request_timeout = request_timeout
        self._restart_timeout = restart_timeout
        self._on_resubmit = on_resubmit  # (how many) for the metrics
        self._disconnected_since: float | None = None  # while requests wait for a scheduler to come back
        self._queue_full = False  # the scheduler's latest word on its waiting queue
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._decoder = MessageDecoder([MessageType.ENGINE_OUTPUTS, MessageType.ENGINE_ERROR])
        self._streams: dict[str, RequestStream] = {}
        self._orphans: set[str] = set()  # failed locally; the scheduler may still hold them
        self._outbox: asyncio.Queue[tuple[msgspec.Struct, list[bytes]]] = asyncio.Queue()  # (message, frames)
        self._connected = asyncio.Event()
        self._last_progress = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        sock = make_socket(self._ctx, zmq.DEALER, identity=self.frontend_id.encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop a message to a live scheduler
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.scheduler_address)
        self._sock = sock
        self._tasks = [asyncio.create_task(coro, name=f"engine-client-{coro.__name__}") for coro in (
            self._monitor_loop(monitor), self._recv_loop(), self._send_loop(), self._heartbeat_loop(),
            self._watchdog_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._fail_all(ServiceUnavailableError("the frontend is shutting down"))
        if self._sock is not None:
            # Deliver what is queued (aborts above all), giving up after a short linger.
            sync_sock = zmq.Socket.shadow(self._sock.underlying)
            while not self._outbox.empty():
                try:
                    sync_sock.send_multipart(self._outbox.get_nowait()[1], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
            self._sock = None
        self._ctx.destroy(linger=500)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def queue_full(self) -> bool:
        """The scheduler's latest word: its waiting queue is full (new requests get 429)."""
        return self._queue_full

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    # --- requests -----------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                       arrival_time: float | None = None, priority: int = 0,
                       cache_salt: str | None = None,
                       pooling_params: PoolingParams | None = None,
                       lora_request: LoRARequest | None = None,
                       images: list[ImageInput] | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes.

        Closing the iterator before the last output (client gone, stop string
        matched) aborts the request in the scheduler. A scheduler lost midway
        is waited for and the request resubmitted (see the module docstring).
        Raises ServiceUnavailableError when no scheduler is reachable in time,
        and the scheduler's own rejection (e.g. prompt too long) as a
        PagedServeError.
        """
        deadline = None if self._request_timeout is None else time.monotonic() + self._request_timeout
        await self.ensure_connected()  # (waiting at most the request timeout, see frontend_cli)
        if request_id in self._streams:  # checked after the last await: no other task can slip in
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        request = EngineRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params,
            arrival_time=time.time() if arrival_time is None else arrival_time, priority=priority,
            cache_salt=cache_salt, pooling_params=pooling_params, lora_request=lora_request,
            images=images or [])
        try:
            frames = encode(request)
        except (OverflowError, TypeError, UnicodeEncodeError, msgspec.EncodeError) as e:  # e.g. an integer beyond 64 bits
            raise InvalidRequestError(f"the request holds a value that cannot be sent: {e}") from None
        stream = RequestStream(request)
        if not self._streams:
            self._last_progress = time.monotonic()  # idle time is not a stall
        self._streams[request_id] = stream
        try:
            self._outbox.put_nowait((request, frames))
            while True:
                item = await (stream.queue.get() if deadline is None else self._get_before(stream, deadline))
                if isinstance(item, RequestTimeoutError):
                    raise item  # still running in the scheduler: the finally clause aborts it
                if isinstance(item, Exception):
                    stream.finished = True  # the scheduler no longer has it (or is gone)
                    raise item
                if item.request_finished:  # (with n > 1, a sample's finish is not the request's)
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self.abort([request_id])

    async def _get_before(self, stream: RequestStream, deadline: float) -> RequestOutput | Exception:
        try:
            return await asyncio.wait_for(stream.queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return RequestTimeoutError(self._request_timeout)

    def abort(self, request_ids: list[str]) -> None:
        """Ask the scheduler to drop these requests, or samples of them (idempotent,
        never blocks). An aborted sample of a request in flight is never resubmitted."""
        for request_id in request_ids:
            if request_id not in self._streams:
                stream = self._streams.get(parent_request_id(request_id))
                if stream is not None:
                    index = request_id.rpartition("#")[2]
                    if request_id == sample_request_id(stream.request_id, int(index)):
                        stream.sample_stopped(int(index))
        if request_ids and self._sock is not None:
            self._post(Abort(request_ids=list(request_ids)))

    def _post(self, msg: msgspec.Struct) -> None:
        self._outbox.put_nowait((msg, encode(msg)))

    async def ensure_connected(self) -> None:
        """Return once connected (waiting `connect_grace` at most) and the
        scheduler takes new requests; else raise ServiceUnavailableError or
        OverloadedError: callers check before starting a response."""
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), self._connect_grace)
            except asyncio.TimeoutError:
                raise ServiceUnavailableError(
                    f"the scheduler at {self.scheduler_address} is not reachable") from None
        if self._queue_full:
            raise OverloadedError()

    def end_all(self, error: Exception) -> None:
        """End every in-flight request with `error` and tell the scheduler, which
        is still there, to drop them (the frontend is going away)."""
        request_ids = list(self._streams)
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self.abort(request_ids)

    def _fail_all(self, error: Exception) -> None:
        """Fail every in-flight request; remember them so that a scheduler which
        is still (or again) there is told to drop them."""
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
            stream.needs_resubmit = False
        self._orphans.update(self._streams)

    def _resubmit(self, streams: list[RequestStream]) -> None:
        """Send these requests again, each as its next attempt from its tokens so
        far, after an abort of whatever the scheduler may still hold of them."""
        streams = [s for s in streams if not s.finished]
        for stream in [s for s in streams if s.attempt >= MAX_RESUBMISSIONS]:
            # Like a request that kills workers, one that keeps losing its scheduler (perhaps
            # because it crashes it) is failed rather than fed to the next one forever.
            logger.error("request %s lost its scheduler %d times: failing it", stream.request_id, stream.attempt + 1)
            stream.queue.put_nowait(ServiceUnavailableError(
                f"the scheduler was lost {stream.attempt + 1} times while running this request; giving up"))
            self._orphans.add(stream.request_id)
            streams.remove(stream)
        if not streams:
            return
        logger.warning("resubmitting %d in-flight requests to the scheduler at %s with the tokens they had "
                       "produced", len(streams), self.scheduler_address)
        if self._on_resubmit is not None:
            self._on_resubmit(len(streams))
        self._post(Abort(request_ids=[s.request_id for s in streams]))
        for stream in streams:
            request = stream.resubmission()
            self._outbox.put_nowait((request, encode(request)))

    # --- background tasks -----------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = await arecv(self._sock, self._decoder)
            self._last_progress = time.monotonic()
            self._dispatch(msg)

    def _dispatch(self, msg: EngineOutputs | EngineError) -> None:
        if isinstance(msg, EngineOutputs):
            self._queue_full = msg.queue_full
            for output in msg.outputs:
                stream = self._streams.get(output.request_id)
                if stream is None or output.attempt != stream.attempt:
                    continue  # already closed (aborted, stopped by a stop string), or a replaced attempt's
                if output.error is not None:
                    stream.queue.put_nowait(InvalidRequestError(output.error))
                else:
                    stream.accept(output)
            if msg.dropped:
                dropped = [stream for request_id, attempt in msg.dropped.items()
                           if (stream := self._streams.get(request_id)) is not None and stream.attempt == attempt]
                if dropped:
                    logger.warning("the scheduler dropped %d of this frontend's requests (it had not heard "
                                   "from it in time)", len(dropped))
                self._resubmit(dropped)
        elif isinstance(msg, EngineError):
            stream = self._streams.get(msg.request_id)
            if stream is not None and msg.attempt == stream.attempt:
                stream.queue.put_nowait(error_with_status(msg.message, msg.status))
            else:
                logger.warning("scheduler error for unknown request %s: %s", msg.request_id, msg.message)

    async def _send_loop(self) -> None:
        while True:
            msg, frames = await self._outbox.get()
            try:
                await self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                # No connected scheduler (ZMQ_IMMEDIATE): the request goes out again on reconnection.
                if isinstance(msg, EngineRequest):
                    stream = self._streams.get(msg.request_id)
                    if stream is not None and stream.attempt == msg.attempt:
                        stream.needs_resubmit = True

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            if self._connected.is_set():
                self._post(FrontendHello(frontend_id=self.frontend_id))

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    logger.info("connected to the scheduler at %s", self.scheduler_address)
                    self._connected.set()
                    self._disconnected_since = None
                    self._queue_full = False  # a (new) scheduler says so itself when full
                    self._last_progress = time.monotonic()
                    self._post(FrontendHello(frontend_id=self.frontend_id))
                    if self._orphans:
                        self.abort(sorted(self._orphans))
                        self._orphans.clear()
                    self._resubmit([s for s in self._streams.values() if s.needs_resubmit])
                elif event == zmq.EVENT_DISCONNECTED:
                    self._connected.clear()
                    if self._disconnected_since is None:
                        self._disconnected_since = time.monotonic()
                    for stream in self._streams.values():
                        stream.needs_resubmit = True
                    if self._streams:
                        logger.error("lost the scheduler at %s: %d in-flight requests wait up to %.0fs for it to "
                                     "come back", self.scheduler_address, len(self._streams), self._restart_timeout)
        finally:
            monitor.close(linger=0)

    async def _watchdog_loop(self) -> None:
        period = max(0.05, min(1.0, self._stall_timeout / 4, self._restart_timeout / 4))
        while True:
            await asyncio.sleep(period)
            if self._disconnected_since is not None:
                self._check_restart_wait()
                continue
            if self._health_probe is None:
                continue  # without a second opinion a quiet scheduler may just be busy
            if not self._streams or time.monotonic() - self._last_progress < self._stall_timeout:
                continue
            try:
                healthy = await self._health_probe()
            except Exception:  # a probe that fails to answer means "not healthy"
                healthy = False
            if healthy:
                self._last_progress = time.monotonic()  # busy, not dead: look again later
                continue
            stalled = list(self._streams)
            silent_for = time.monotonic() - self._last_progress
            logger.error("no output from the scheduler for %.1fs and it is not healthy: failing %d requests",
                         silent_for, len(self._streams))
            self._fail_all(ServiceUnavailableError(
                f"the scheduler stopped responding (no output for {silent_for:.0f}s, health check failed)"))
            self.abort(stalled)
            self._last_progress = time.monotonic()

    def _check_restart_wait(self) -> None:
        """Fail the requests waiting for a lost scheduler once it has been away too long."""
        away = time.monotonic() - self._disconnected_since
        if away < self._restart_timeout or not self._streams:
            return
        logger.error("the scheduler at %s has been unreachable for %.0fs: failing %d in-flight requests",
                     self.scheduler_address, away, len(self._streams))
        self._fail_all(ServiceUnavailableError(
            f"lost the connection to the scheduler, and it did not come back within {self._restart_timeout:.0f}s"))
        self._disconnected_since = time.monotonic()  # requests sent from now on get a wait of their own
