"""Encoding of protocol messages onto ZeroMQ frames, and typed decoding.

A message is two frames: [type byte, msgpack body] (ROUTER sockets prepend
the peer identity). `MessageDecoder` accepts only the types a socket expects;
anything else (garbage, wrong type, oversized) raises `BadFrame`, which socket
loops log and drop.
"""
from __future__ import annotations

import logging
from typing import Iterable

import msgspec
import zmq

from common.protocol import MESSAGE_TYPES, TYPE_OF, MessageType

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # also set as ZMQ_MAXMSGSIZE on every socket

_encoder = msgspec.msgpack.Encoder()


class BadFrame(ValueError):
    """A frame that is not a valid message for this socket."""


def encode(msg: msgspec.Struct) -> list[bytes]:
    return [bytes([TYPE_OF[type(msg)]]), _encoder.encode(msg)]


class MessageDecoder:
    """Decodes [type byte, body] into exactly one of the expected Struct types."""

    def __init__(self, expected: Iterable[MessageType]):
        self._decoders = {int(t): msgspec.msgpack.Decoder(MESSAGE_TYPES[t]) for t in expected}

    def decode(self, frames: list[bytes]) -> msgspec.Struct:
        if len(frames) != 2:
            raise BadFrame(f"expected 2 frames, got {len(frames)}")
        type_frame, body = frames
        if len(type_frame) != 1:
            raise BadFrame(f"type frame must be 1 byte, got {len(type_frame)}")
        decoder = self._decoders.get(type_frame[0])
        if decoder is None:
            raise BadFrame(f"unexpected message type {type_frame[0]}")
        if len(body) > MAX_MESSAGE_BYTES:
            raise BadFrame(f"message of {len(body)} bytes exceeds the limit")
        try:
            return decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadFrame(f"undecodable {MessageType(type_frame[0]).name}: {e}") from None


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None,
                connect: str | None = None, identity: bytes | None = None) -> zmq.Socket:
    """A socket with the project's defaults: message size limit, no linger,
    and ROUTER sockets that neither drop queued messages nor block on a
    vanished peer (ROUTER_MANDATORY stays off)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer reclaims its identity
        sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops silently at the high-water mark: never drop outputs
    if bind:
        sock.bind(bind)
    if connect:
        sock.connect(connect)
    return sock


def send(sock: zmq.Socket, msg: msgspec.Struct, *, to: bytes | None = None, flags: int = 0) -> None:
    frames = encode(msg)
    if to is not None:
        frames = [to, *frames]
    sock.send_multipart(frames, flags=flags, copy=False)


def _decode_or_drop(frames: list[bytes], decoder: MessageDecoder, routed: bool):
    """The message (or (peer, message)), or None after logging a bad frame."""
    peer = None
    if routed:
        if not frames:
            return None
        peer, frames = frames[0], frames[1:]
    try:
        msg = decoder.decode(frames)
    except BadFrame as e:
        logger.error("dropped a bad frame%s: %s", f" from {peer!r}" if peer else "", e)
        return None
    return (peer, msg) if routed else msg


def recv(sock: zmq.Socket, decoder: MessageDecoder, *, routed: bool = False, flags: int = 0):
    """Receive one valid message, dropping (and logging) bad frames.

    Returns the message, or (peer identity, message) when `routed`. With
    flags=zmq.NOBLOCK it raises zmq.Again once no message is waiting.
    """
    while True:
        result = _decode_or_drop(sock.recv_multipart(flags), decoder, routed)
        if result is not None:
            return result

async def arecv(sock, decoder: MessageDecoder, *, routed: bool = False):
    """`recv` for zmq.asyncio sockets."""
    while True:
        result = _decode_or_drop(await sock.recv_multipart(), decoder, routed)
        if result is not None:
            return result
