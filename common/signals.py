"""Graceful stop on SIGTERM (docker, supervisors) and SIGINT (Ctrl-C)."""
from __future__ import annotations

import signal
from typing import Callable


def on_stop_signals(stop: Callable[[], None]) -> None:
    """Call `stop()` on SIGTERM or SIGINT; the process's loop then exits cleanly."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop())
