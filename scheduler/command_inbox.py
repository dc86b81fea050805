"""Commands from other threads (the gRPC control service) to the engine loop.

ZeroMQ sockets are not thread-safe and the loop sleeps in a zmq poll, so a
command goes into a queue and a one-byte message on an inproc socket wakes
the loop, which runs it between steps and answers through a Future.
"""
from __future__ import annotations

import queue
from concurrent.futures import Future

import zmq

from common.transport import make_socket


class CommandInbox:
    def __init__(self, ctx: zmq.Context):
        self._ctx = ctx
        self._address = f"inproc://scheduler-wakeup-{id(self)}"
        self.socket = make_socket(ctx, zmq.PULL, bind=self._address)  # the loop polls this
        self._commands: queue.Queue[tuple[str, Future]] = queue.Queue()

    def submit(self, name: str) -> Future:
        """Any thread: queue a command and wake the loop; the Future gets its result."""
        future: Future = Future()
        self._commands.put((name, future))
        sock = self._ctx.socket(zmq.PUSH)  # one per call: zmq sockets are not thread-safe
        try:
            sock.connect(self._address)
            sock.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the loop has a wakeup pending already
        finally:
            sock.close(linger=0)
        return future

    def take(self) -> list[tuple[str, Future]]:
        """The loop's thread: every queued command (the wakeups are consumed)."""
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        taken = []
        while not self._commands.empty():
            taken.append(self._commands.get_nowait())
        return taken

    def close(self) -> None:
        self.socket.close(linger=0)
