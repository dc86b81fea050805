"""Which peers of a ROUTER socket are still connected, from ZeroMQ's own events.

A ROUTER socket never says that a peer went away, but its monitor does, at
once: a process that dies (even by SIGKILL) has its connections closed by the
kernel, and ZMTP heartbeats close the connection to a host that vanished. The
monitor names the connection's file descriptor, not the peer, so the tracker
remembers the descriptor each peer's latest message arrived on (ZMQ_SRCFD)
and turns a disconnect into the identity of the peer that is gone.

A descriptor can be reused by a new connection right after the old one
closes; a disconnect is only charged to a peer whose latest message came on
that very descriptor, and the rare misattribution costs one recompute (a
worker) or one abort (a frontend that reconnected within milliseconds).
"""
from __future__ import annotations

import logging

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from common.transport import BadFrame, MessageDecoder

logger = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000  # ZMTP pings to every peer
HEARTBEAT_TIMEOUT_MS = 3000  # a peer silent this long (no traffic, no pong) is disconnected


def enable_heartbeats(sock: zmq.Socket) -> None:
    """ZMTP heartbeats, answered by ZeroMQ's I/O thread even while the peer's
    Python code is busy (a worker in a long step is not mistaken for dead)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


class PeerTracker:
    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._fd_of: dict[bytes, int] = {}
        self._peer_on: dict[int, bytes] = {}

    def recv(self, decoder: MessageDecoder) -> tuple[bytes, msgspec.Struct] | None:
        """One waiting message as (peer, message), noting the peer's connection;
        None for a bad frame (logged and dropped). Raises zmq.Again when none waits."""
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(frames) < 2:
            return None
        peer = frames[0].bytes
        try:
            msg = decoder.decode([frame.bytes for frame in frames[1:]])
        except BadFrame as e:
            logger.error("dropped a bad frame from %r: %s", peer, e)
            return None
        try:
            self._note(peer, frames[0].get(zmq.SRCFD))
        except zmq.ZMQError:  # a libzmq without SRCFD: heartbeats and timeouts still work
            pass
        return peer, msg

    def _note(self, peer: bytes, fd: int) -> None:
        old = self._fd_of.get(peer)
        if old == fd:
            return
        if old is not None and self._peer_on.get(old) == peer:
            del self._peer_on[old]
        self._fd_of[peer] = fd
        self._peer_on[fd] = peer

    def forget(self, peer: bytes) -> None:
        fd = self._fd_of.pop(peer, None)
        if fd is not None and self._peer_on.get(fd) == peer:
            del self._peer_on[fd]

    def disconnected_peers(self) -> list[bytes]:
        """Peers whose connection closed since the last call."""
        gone = []
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return gone
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            peer = self._peer_on.pop(event["value"], None)
            if peer is not None:
                del self._fd_of[peer]
                gone.append(peer)

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
