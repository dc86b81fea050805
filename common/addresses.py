"""Default internal addresses; each can be set by flag or PAGEDSERVE_* environment variable."""
from __future__ import annotations

import errno
import os
import socket

DEFAULTS = {
    "SCHEDULER_ADDRESS": "tcp://127.0.0.1:5555",  # frontends -> scheduler (ZMQ)
    "TOKENIZER_ADDRESS": "tcp://127.0.0.1:5556",  # frontends -> tokenizer router (ZMQ)
    "TOKENIZER_BACKEND_ADDRESS": "tcp://127.0.0.1:5557",  # tokenizer processes -> router (ZMQ)
    "WORKER_ADDRESS": "tcp://127.0.0.1:5558",  # workers -> scheduler (ZMQ)
    "SCHEDULER_CONTROL_ADDRESS": "127.0.0.1:50052",  # scheduler control service (gRPC)
}


def default_address(name: str) -> str:
    return os.environ.get(f"PAGEDSERVE_{name}", DEFAULTS[name])


def unix_socket_path(address: str) -> str | None:
    """The file of a ZeroMQ `ipc://` or gRPC `unix:` address (None for others)."""
    for prefix in ("ipc://", "unix://", "unix:"):
        if address.startswith(prefix):
            return address[len(prefix):]
    return None


def refuse_if_in_use(address: str) -> None:
    """Raise if a live process listens on this Unix-socket address.

    Binding a Unix socket replaces its file without an error (ZeroMQ and gRPC
    unlink it first), so a second copy of a component would silently take the
    address over while the first still serves (and the first would delete the
    file when it exits). TCP refuses such a bind by itself (EADDRINUSE); this
    makes Unix sockets do the same. A stale file (nobody listening) is fine."""
    path = unix_socket_path(address)
    if path is None or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return  # left behind by a process that is gone
        raise OSError(e.errno, f"cannot check {address}: {e.strerror}") from None
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"{address} is in use: another process listens on it (is this component "
                                    f"already running?)")


# grpc sets SO_REUSEPORT by default: a second server on a TCP port in use would
# bind without an error and the kernel would split new connections between the
# two, so clients of one server would silently reach the other.
GRPC_SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


def bind_grpc_port(server, address: str, credentials=None) -> int:
    """Add a listening address to a grpc (or grpc.aio) server created with
    GRPC_SERVER_OPTIONS, with TLS when given `credentials` (grpc.ServerCredentials);
    returns the port. Raises OSError when the address is in use or cannot be
    bound (grpc itself returns 0 or raises RuntimeError)."""
    refuse_if_in_use(address)
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(errno.EADDRINUSE, f"cannot listen on {address}: the port is in use (is this component "
                                        f"already running?) or the address is not valid here")
    return port
