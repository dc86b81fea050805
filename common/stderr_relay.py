"""A component's stderr, copied to `serve`'s line by line, keeping its last line.

`serve` reads each component's stderr through a pipe rather than letting it
inherit its own, so that when a component exits, the supervisor's line about it
can say why (its last words: a usage error, the exception) instead of leaving
the reason somewhere above among the other components' logs.
"""
from __future__ import annotations

import sys
import threading
from typing import BinaryIO

from common.logging_setup import LINE_PREFIX

_JOIN_S = 0.5  # a grandchild that inherited the pipe keeps it open: do not wait for EOF long


class StderrRelay:
    def __init__(self, stream: BinaryIO, out: BinaryIO | None = None):
        self._stream = stream
        self._out = out if out is not None else sys.stderr.buffer
        self._last = ""
        self._thread = threading.Thread(target=self._run, name="stderr-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._stream:
            for line in iter(self._stream.readline, b""):
                try:
                    self._out.write(line)
                    self._out.flush()
                except (OSError, ValueError):  # our stderr closed: keep draining, or the component blocks
                    pass
                text = line.decode(errors="replace").strip()
                if text:
                    self._last = LINE_PREFIX.sub("", text, count=1)  # the supervisor's own line says who and when

    def last_line(self) -> str:
        """The last non-blank line the component wrote, once its output has ended (or after a short wait)."""
        self._thread.join(_JOIN_S)
        return self._last
