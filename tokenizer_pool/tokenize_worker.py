"""A tokenizer worker process: one tokenizer, one job at a time.

It connects a DEALER socket (identity = its worker_id) to the router's backend
address, announces itself with TokenizerReady, and answers every job with a
TokenizerReply. A side thread repeats TokenizerReady on its own socket every
`heartbeat_interval` seconds, even while a long job runs, so the router can
tell a busy worker from a dead one (ZeroMQ sockets are single-threaded, hence
the second socket; the router reads the worker's name from the message).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

import zmq

from common.logging_setup import setup_logging
from common.proctitle import set_process_title
from common.protocol import MessageType, TokenizerReady
from common.transport import MessageDecoder, make_socket, recv, send
from tokenizer_pool.image_decoding import ImageLimits

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL = 1.0
STOP_POLL_MS = 200  # how soon an idle worker notices a stop
REPORT_INTERVAL = 60.0  # seconds between "served N jobs" log lines while jobs come
JOB_TYPES = (MessageType.TOKENIZE, MessageType.RENDER_CHAT, MessageType.DETOKENIZE)
_PR_SET_PDEATHSIG = 1


def serve(tokenizer, backend_addr: str, worker_id: str, *,
          heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL, ctx: zmq.Context | None = None,
          stopping: threading.Event | None = None, images=None) -> None:
    """Answer jobs until `stopping` is set (SIGTERM sets it in a worker process), then finish the
    job at hand, tell the router this worker is leaving, and return. The router then gives
    anything it sent meanwhile to another worker, uncharged: a stop is not a crash. `images`: the
    ChatImages chat jobs with image parts use (None: such jobs are refused)."""
    from tokenizer_pool.jobs import run_job  # imports transformers: keep it out of the router process

    ctx = ctx or zmq.Context.instance()
    stopping = stopping or threading.Event()
    sock = make_socket(ctx, zmq.DEALER, connect=backend_addr, identity=worker_id.encode())
    send(sock, TokenizerReady(worker_id=worker_id))
    heartbeat = Heartbeat(ctx, backend_addr, worker_id, heartbeat_interval)
    heartbeat.start()
    decoder = MessageDecoder(JOB_TYPES)
    logger.info("tokenizer worker %s serving jobs from %s", worker_id, backend_addr)
    served = JobCounter(worker_id)
    try:
        while not stopping.is_set():
            if not sock.poll(STOP_POLL_MS):
                continue
            job = recv(sock, decoder)  # bad frames are logged and dropped
            send(sock, run_job(tokenizer, job, images))
            served.add()
        heartbeat.stop()
        heartbeat.join()  # no heartbeat may follow the goodbye and sign this worker up again
        send(sock, TokenizerReady(worker_id=worker_id, leaving=True))
        logger.info("tokenizer worker %s stopping after %d jobs", worker_id, served.total)
    finally:
        heartbeat.stop()
        sock.close(linger=200)  # let the goodbye out, without waiting long for a router that is gone


class JobCounter:
    """Logs a worker's first job and then, at most every REPORT_INTERVAL seconds, how many it
    served: enough for an operator (and the compose test) to see which workers take load."""

    def __init__(self, worker_id: str, interval: float = REPORT_INTERVAL):
        self.worker_id, self.interval = worker_id, interval
        self.total = self.reported = 0
        self.last_report = time.monotonic()

    def add(self) -> None:
        self.total += 1
        now = time.monotonic()
        if self.total == 1:
            logger.info("tokenizer worker %s served its first job", self.worker_id)
        elif now - self.last_report >= self.interval:
            logger.info("tokenizer worker %s served %d jobs (%d in the last %.0f s)", self.worker_id,
                        self.total, self.total - self.reported, now - self.last_report)
        else:
            return
        self.reported, self.last_report = self.total, now


class Heartbeat(threading.Thread):
    """Sends TokenizerReady every `interval` seconds from its own socket."""

    def __init__(self, ctx: zmq.Context, backend_addr: str, worker_id: str, interval: float):
        super().__init__(name="tokenizer-heartbeat", daemon=True)
        self._ctx, self._addr, self._worker_id, self._interval = ctx, backend_addr, worker_id, interval
        self._stopped = threading.Event()

    def run(self) -> None:
        sock = make_socket(self._ctx, zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no backlog of stale heartbeats while the router is away
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.connect(self._addr)
        try:
            while not self._stopped.wait(self._interval):
                try:
                    send(sock, TokenizerReady(worker_id=self._worker_id), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected right now; the next beat will try again
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stopped.set()


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel sends SIGTERM when the parent dies, so even a SIGKILLed
    pool leaves no orphans. Exits now if the parent is already gone."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(0)


def worker_main(model_dir: str, backend_addr: str, worker_id: str, index: int, parent_pid: int,
                heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL, log_level: str | None = None,
                chat_template: str | None = None, image_limits: ImageLimits = ImageLimits()) -> None:
    """Process entry point (spawned by tokenizer_pool.pool_supervisor). `chat_template`:
    the template text replacing the model's (--chat-template); `image_limits`: what chat
    images may be (--limit-mm-per-prompt, --allowed-media-domains)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    die_with_parent(parent_pid)
    set_process_title(f"pagedserve: tokenizer {index}")
    setup_logging(f"tokenizer {index}", log_level)
    from common.tokenizer import load_tokenizer  # heavy (transformers): only in the child

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())  # finish the job at hand, then leave
    tokenizer = load_tokenizer(model_dir, chat_template)
    from tokenizer_pool.chat_images import ChatImages

    serve(tokenizer, backend_addr, worker_id, heartbeat_interval=heartbeat_interval, stopping=stopping,
          images=ChatImages(model_dir, image_limits))
