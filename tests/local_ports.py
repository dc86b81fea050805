"""Free local TCP ports for the servers and sockets tests start."""
from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A local TCP port nothing listens on now, and never one this process was handed before.

    Two binds to port 0 in a row can get the same free port from the kernel (about one pair
    in 10,000 here), and a test that asks for two addresses would then start a component
    whose second bind fails: it exits with "Address already in use" and the test waits in vain."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
