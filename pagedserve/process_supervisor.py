"""Start, watch, restart and stop component processes (used by `pagedserve serve`)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from common.errors import USAGE_ERROR
from common.stderr_relay import StderrRelay

logger = logging.getLogger("pagedserve.supervisor")

MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0  # a component up this long has its backoff reset
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: if the supervisor dies, so does the child."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_tcp_port() -> int:
    """A port nothing listens on now, for a worker group's rendezvous on this host."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def describe_exit(code: int) -> str:
    """Popen's return code in words: a negative code is the signal that killed it."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Component:
    name: str
    argv: list[str]  # arguments after `pagedserve`
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 1.0
    restart_at: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    relay: StderrRelay | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pagedserve.cli", *self.argv]


class Supervisor:
    def __init__(self, components: list[Component]):
        self.components = components
        self.stopping = False
        self.exit_code = 0  # what serve exits with: USAGE_ERROR when it gave up on a component

    def start(self, component: Component) -> None:
        component.process = subprocess.Popen(component.command(), env={**os.environ, **component.env},
                                             stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        component.relay = StderrRelay(component.process.stderr)
        component.started_at = time.monotonic()
        component.restart_at = None
        logger.info("started %s (pid %d)", component.name, component.process.pid)

    def start_all(self) -> None:
        for component in self.components:
            self.start(component)

    def poll(self) -> None:
        """Restart components that exited, with exponential backoff."""
        now = time.monotonic()
        for c in self.components:
            if self.stopping or c.process is None:
                continue
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.restarts += 1
                    logger.warning("restarting %s (restart #%d)", c.name, c.restarts)
                    self.start(c)
                continue
            code = c.process.poll()
            if code is None:
                if now - c.started_at > HEALTHY_AFTER_S:
                    c.backoff_s = 1.0
                continue
            how = describe_exit(code) + self._last_words(c, code)
            if code == USAGE_ERROR:
                logger.error("%s (pid %d) %s; not restarting it: exit status 2 is a usage error, which the same "
                             "settings would repeat; stopping", c.name, c.process.pid, how)
                self.exit_code = USAGE_ERROR
                self.request_stop()
                return
            c.restart_at = now + c.backoff_s
            logger.warning("%s (pid %d) %s; restarting in %.0fs", c.name, c.process.pid, how, c.backoff_s)
            c.backoff_s = min(MAX_BACKOFF_S, c.backoff_s * 2)

    @staticmethod
    def _last_words(c: Component, code: int) -> str:
        """': <its last line>' for a component that exited by itself with an error (not one
        killed by a signal: what it last logged then is no reason)."""
        last = c.relay.last_line() if c.relay is not None and code > 0 else ""
        return f": {last}" if last else ""

    def request_stop(self) -> None:
        self.stopping = True

    def stop_all(self) -> None:
        """Stop the API first and wait for it: it takes no new work and lets the
        requests in flight finish within its grace period, which needs the rest
        still running. Then SIGTERM the others; SIGKILL stragglers."""
        self.stopping = True
        running = [c for c in reversed(self.components) if c.process and c.process.poll() is None]
        for batch in (running[:1], running[1:]):
            for c in batch:
                logger.info("stopping %s (pid %d)", c.name, c.process.pid)
                c.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for c in batch:
                try:
                    c.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time; killing it", c.name)
                    c.process.kill()
                    c.process.wait()
        for c in running:
            c.relay.last_line()  # let its final lines through before serve exits
