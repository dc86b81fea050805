"""Running the tokenizer pool: the router plus K local workers in one process
group, or (join mode) only workers that serve an existing router elsewhere.

One poll loop watches the router's two sockets, every child's exit sentinel
and a self-pipe written by the signal handlers, and sleeps until one of them
fires or the next timer (liveness check, delayed restart) is due.
"""
from __future__ import annotations

import logging
import os
import signal
from urllib.parse import urlsplit

import zmq

from common.proctitle import set_process_title
from common.tokenizer import load_chat_template
from common.transport import stop_authenticator
from tokenizer_pool.image_decoding import ImageLimits
from tokenizer_pool.router import Router
from tokenizer_pool.pool_supervisor import WorkerSupervisor
from tokenizer_pool.tokenize_worker import DEFAULT_HEARTBEAT_INTERVAL

logger = logging.getLogger(__name__)

DEFAULT_LIVENESS_TIMEOUT = 5.0


def run_tokenizer_pool(model: str, frontend_addr: str, backend_addr: str, pool_size: int = 2, *,
                       model_cache_dir: str | None = None, heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
                       liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT, log_level: str | None = None,
                       chat_template: str | None = None, image_limits: ImageLimits = ImageLimits()) -> None:
    """Router + `pool_size` local workers (0: a router that only remote workers
    serve), until SIGTERM or SIGINT. `chat_template`: the --chat-template value;
    `image_limits`: what chat images may be (see tokenize_worker.worker_main)."""
    set_process_title("pagedserve: tokenizer")
    model_dir = _resolve(model, model_cache_dir) if pool_size > 0 else ""
    template = load_chat_template(chat_template)  # a bad one fails before anything is bound
    ctx = zmq.Context()
    router = Router(ctx, frontend_addr, backend_addr, liveness_timeout=liveness_timeout)
    supervisor = WorkerSupervisor(pool_size, model_dir, local_connect_address(backend_addr),
                                  heartbeat_interval=heartbeat_interval, log_level=log_level,
                                  chat_template=template, image_limits=image_limits)
    try:
        _run(supervisor, router)
    finally:
        router.close()
        stop_authenticator(ctx)  # with CURVE, its ZAP sockets would keep ctx.term() waiting forever
        ctx.term()


def run_join_workers(model: str, router_backend_addr: str, pool_size: int = 1, *,
                     model_cache_dir: str | None = None, heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
                     log_level: str | None = None, chat_template: str | None = None,
                     image_limits: ImageLimits = ImageLimits()) -> None:
    """`pool_size` workers that join the router at `router_backend_addr`."""
    set_process_title("pagedserve: tokenizer (join)")
    supervisor = WorkerSupervisor(pool_size, _resolve(model, model_cache_dir), router_backend_addr,
                                  heartbeat_interval=heartbeat_interval, log_level=log_level,
                                  chat_template=load_chat_template(chat_template), image_limits=image_limits)
    logger.info("starting %d tokenizer worker(s) for the router at %s", pool_size, router_backend_addr)
    _run(supervisor, None)


def local_connect_address(bind_addr: str) -> str:
    """Where a local child connects to reach a socket bound to `bind_addr`
    (a wildcard host such as tcp://0.0.0.0:5557 or tcp://*:5557 means loopback)."""
    parts = urlsplit(bind_addr)
    if parts.scheme == "tcp" and parts.hostname in ("*", "0.0.0.0", "::", ""):
        return f"tcp://127.0.0.1:{parts.port}"
    return bind_addr


def _resolve(model: str, cache_dir: str | None) -> str:
    """A directory with the tokenizer files. A tokenizer-only directory (no
    weights) is enough here; anything else goes through resolve_model_dir."""
    path = os.path.abspath(os.path.expanduser(model))
    if any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        return path
    from common.model_files import resolve_model_dir

    return resolve_model_dir(model, cache_dir)


def _run(supervisor: WorkerSupervisor, router: Router | None) -> None:
    with StopSignals() as stop:
        try:
            supervisor.start_all()
            _loop(supervisor, router, stop)
        finally:
            logger.info("tokenizer pool stopping")
            supervisor.stop()


def _loop(supervisor: WorkerSupervisor, router: Router | None, stop: StopSignals) -> None:
    poller = zmq.Poller()
    poller.register(stop.fd, zmq.POLLIN)
    if router is not None:
        poller.register(router.frontend, zmq.POLLIN)
        poller.register(router.backend, zmq.POLLIN)
    watched: set[int] = set()
    while not stop.requested:
        sentinels = set(supervisor.sentinels())
        for fd in watched - sentinels:
            poller.unregister(fd)
        for fd in sentinels - watched:
            poller.register(fd, zmq.POLLIN)
        watched = sentinels
        timers = [supervisor.seconds_until_restart()]
        if router is not None:
            timers.append(router.seconds_until_liveness_check())
        timers = [t for t in timers if t is not None]
        timeout_ms = None if not timers else max(1, int(min(timers) * 1000) + 1)
        events = dict(poller.poll(timeout_ms))
        if router is not None:
            if router.frontend in events:
                router.on_frontend_readable()
            if router.backend in events:
                router.on_backend_readable()
        if watched & events.keys():
            for worker_id in supervisor.reap():
                # `sentinels()` no longer lists the dead child; the fd is unregistered next round
                if router is not None:
                    router.remove_worker(worker_id, "process exited")
        supervisor.restart_due()
        if router is not None:
            router.check_liveness()
        if stop.fd in events:
            stop.drain()


class StopSignals:
    """SIGTERM/SIGINT set `requested` and wake the poll loop through a pipe."""

    def __init__(self) -> None:
        self.requested = False
        self.fd = -1
        self._write_fd = -1
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1

    def __enter__(self) -> StopSignals:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        if not self.requested:
            logger.info("received %s", signal.Signals(signum).name)
        self.requested = True

    def drain(self) -> None:
        try:
            while os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self.fd)
        os.close(self._write_fd)

