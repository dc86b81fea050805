"""The tests' port helper: every port it hands out is free and distinct."""
from __future__ import annotations

import socket

from local_ports import free_port


def test_free_ports_are_distinct_and_bindable():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports[-20:]:  # nobody holds them: a server can bind each one
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
