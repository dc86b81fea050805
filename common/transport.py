"""Encoding of protocol messages onto ZeroMQ frames, and typed decoding.

A message is two frames: [type byte, msgpack body] (ROUTER sockets prepend
the peer identity). `MessageDecoder` accepts only the types a socket expects;
anything else (garbage, wrong type, oversized) raises `BadFrame`, which socket
loops log and drop.

Components on different hosts can encrypt and authenticate every ZeroMQ
connection with CURVE: give every component the same cluster secret key
(`PAGEDSERVE_CURVE_SECRET_KEY`, or a file named by
`PAGEDSERVE_CURVE_SECRET_KEY_FILE`). ROUTER sockets (the binding side) then
accept only peers that prove they hold it; DEALER sockets use it to connect.
"""
from __future__ import annotations

import hmac
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable

import msgspec
import zmq

from common.addresses import refuse_if_in_use
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


CURVE_SECRET_ENV = "PAGEDSERVE_CURVE_SECRET_KEY"
ZAP_DOMAIN = "pagedserve"


@dataclass(frozen=True)
class CurveKeys:
    """The cluster keypair (Z85 text, 40 characters each)."""
    public: bytes
    secret: bytes

    @classmethod
    def from_secret(cls, secret: str | bytes) -> "CurveKeys":
        secret = secret.strip().encode() if isinstance(secret, str) else secret.strip()
        try:
            return cls(public=zmq.curve_public(secret), secret=secret)
        except (zmq.ZMQError, ValueError) as e:
            raise ValueError(f"not a Z85 CURVE secret key (40 characters): {e}") from None


def curve_keys_from_env() -> CurveKeys | None:
    """The cluster keys from the environment, or None when CURVE is off."""
    secret = os.environ.get(CURVE_SECRET_ENV)
    path = os.environ.get(CURVE_SECRET_ENV + "_FILE")
    if not secret and path:
        with open(path) as f:
            secret = f.read()
    return CurveKeys.from_secret(secret) if secret else None


class _ClusterKeyOnly:
    """ZAP credentials check: only peers holding the cluster key get in."""

    def __init__(self, keys: CurveKeys):
        self._public = keys.public

    def callback(self, domain: str, client_key: bytes) -> bool:
        allowed = hmac.compare_digest(client_key, self._public)
        if not allowed:
            logger.warning("refused a ZeroMQ peer with an unknown CURVE key")
        return allowed


_authenticators: "weakref.WeakKeyDictionary[zmq.Context, object]" = weakref.WeakKeyDictionary()
_authenticators_lock = threading.Lock()


def _ensure_authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """One ZAP handler per context, started before its first CURVE server
    binds. Without one, libzmq would let any CURVE client in."""
    from zmq.auth.thread import ThreadAuthenticator

    with _authenticators_lock:
        if ctx in _authenticators:
            return
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("pagedserve.zap"))
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_ClusterKeyOnly(keys))
        _authenticators[ctx] = auth


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the context's ZAP handler (before destroying a context that had CURVE servers)."""
    with _authenticators_lock:
        auth = _authenticators.pop(ctx, None)
    if auth is not None:
        auth.stop()


def apply_curve(ctx: zmq.Context, sock: zmq.Socket, kind: int, keys: CurveKeys) -> None:
    """ROUTERs (which bind) authenticate peers; DEALERs (which connect) present the key."""
    if kind == zmq.ROUTER:
        _ensure_authenticator(ctx, keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
    elif kind == zmq.DEALER:
        sock.curve_serverkey = keys.public
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None,
                connect: str | None = None, identity: bytes | None = None,
                curve: CurveKeys | None = None) -> zmq.Socket:
    """A socket with the project's defaults: message size limit, no linger,
    ROUTER sockets that neither drop queued messages nor block on a vanished
    peer (ROUTER_MANDATORY stays off), and CURVE when keys are given or set
    in the environment."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    keys = curve or curve_keys_from_env()
    if keys is not None:
        apply_curve(ctx, sock, kind, keys)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer reclaims its identity
        sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops silently at the high-water mark: never drop outputs
    try:
        if bind:
            bind_exclusive(sock, bind)
        if connect:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)  # else the context could never terminate
        raise
    return sock


def bind_exclusive(sock: zmq.Socket, address: str) -> None:
    """Bind, refusing an `ipc://` address another live process listens on (as TCP does)."""
    refuse_if_in_use(address)
    sock.bind(address)


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
