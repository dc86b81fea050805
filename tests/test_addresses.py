"""Unix-socket addresses refuse a second live listener, as TCP ports do."""
from __future__ import annotations

import errno
import socket
from concurrent import futures

import grpc
import pytest
import zmq

from common.addresses import refuse_if_in_use, unix_socket_path
from common.transport import make_socket


def test_unix_socket_paths():
    assert unix_socket_path("ipc:///run/x/scheduler") == "/run/x/scheduler"
    assert unix_socket_path("unix:/run/x/control") == "/run/x/control"
    assert unix_socket_path("unix:///run/x/control") == "/run/x/control"
    assert unix_socket_path("tcp://127.0.0.1:5555") is None and unix_socket_path("127.0.0.1:50052") is None


def test_a_second_zmq_bind_on_a_live_ipc_address_fails(tmp_path):
    address = f"ipc://{tmp_path}/scheduler"
    first_ctx, ctx = zmq.Context(), zmq.Context()  # the first's own, as if in another process
    first = make_socket(first_ctx, zmq.ROUTER, bind=address)
    try:
        with pytest.raises(OSError) as info:
            make_socket(ctx, zmq.ROUTER, bind=address)
        assert info.value.errno == errno.EADDRINUSE and "already running" in str(info.value)
        # The first one still owns its address: a client reaches it.
        client = make_socket(ctx, zmq.DEALER, connect=address)
        client.send(b"hello")
        assert first.poll(5000) and first.recv_multipart()[1] == b"hello"
        client.close()
    finally:
        first.close()
        first_ctx.term()  # returns once its I/O thread has closed the listener, as a process exit would
    # Once its listener is gone (the file may stay behind), the address is free again.
    second = make_socket(ctx, zmq.ROUTER, bind=address)
    second.close()
    ctx.term()


def test_a_live_grpc_unix_socket_is_refused_and_a_stale_file_is_not(tmp_path):
    address = f"unix:{tmp_path}/control"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    assert server.add_insecure_port(address) != 0
    server.start()
    try:
        with pytest.raises(OSError, match="in use"):
            refuse_if_in_use(address)
    finally:
        server.stop(grace=None).wait()
    stale = tmp_path / "stale"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    listener.close()  # the file stays, nobody listens
    refuse_if_in_use(f"ipc://{stale}")
    refuse_if_in_use(f"ipc://{tmp_path}/missing")


def _grpc_server_on_a_free_port() -> tuple[grpc.Server, int]:
    """A gRPC server with grpc's default options, as another process would run it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_tcp_port_another_grpc_server_listens_on_is_refused_by_the_control_service():
    from scheduler.control import ControlState, SchedulerControlServicer, start_control_server

    # grpc sets SO_REUSEPORT by default, so a second server would share the port
    # with the first and take half of its calls, silently.
    other, port = _grpc_server_on_a_free_port()
    try:
        try:
            server = start_control_server(f"127.0.0.1:{port}", SchedulerControlServicer(ControlState(), "m", print))
        except OSError as e:
            error = e
        else:
            server.stop(grace=None).wait()
            error = None
        assert error is not None and "in use" in str(error)
    finally:
        other.stop(grace=None).wait()


def test_a_tcp_port_another_grpc_server_listens_on_is_refused_by_the_client_api():
    import asyncio

    from frontend.grpc.grpc_server import start_grpc_server

    async def start_and_stop() -> None:
        server, _ = await start_grpc_server(None, "127.0.0.1", port)
        await server.stop(grace=None)

    other, port = _grpc_server_on_a_free_port()
    try:
        with pytest.raises(OSError, match="in use"):
            asyncio.run(start_and_stop())
    finally:
        other.stop(grace=None).wait()
