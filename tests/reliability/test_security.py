"""Security defaults: internal sockets on loopback unless configured, a size
limit on every ZeroMQ socket, no pickle anywhere, and CURVE that keeps out
any peer without the cluster key."""
from __future__ import annotations

import ast
import ipaddress
import re
from pathlib import Path

import pytest
import zmq

from common.transport import MAX_MESSAGE_BYTES, CurveKeys, curve_keys_from_env, make_socket, stop_authenticator

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["pagedserve", "common", "scheduler", "worker", "frontend", "tokenizer_pool"]
ADDRESS_FLAGS = ("address", "host", "join")


def component_parsers():
    from pagedserve import serve
    from frontend import frontend_cli
    from scheduler import scheduler_cli
    from tokenizer_pool import tokenizer_pool_cli as tokenizer_cli
    from worker import worker_cli
    return {"frontend": frontend_cli.build_parser(), "scheduler": scheduler_cli.build_parser(),
            "worker": worker_cli.build_parser(), "serve": serve.build_parser(),
            "tokenizer": tokenizer_cli.add_tokenizer_args(__import__("argparse").ArgumentParser())}


def host_of(address: str) -> str | None:
    """The host part of tcp://h:p, h:p or unix:/path (None for ipc/unix/inproc)."""
    if address.startswith(("ipc://", "unix:", "inproc://")):
        return None
    match = re.fullmatch(r"(?:tcp://)?\[?([^\]]+?)\]?(?::\d+)?", address)
    return match.group(1)


@pytest.mark.parametrize("component", ["frontend", "scheduler", "worker", "serve", "tokenizer"])
def test_every_default_address_is_loopback(component, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("PAGEDSERVE_"):
            monkeypatch.delenv(name)
    args = vars(component_parsers()[component].parse_args([]))
    addresses = {k: v for k, v in args.items() if v and any(part in k for part in ADDRESS_FLAGS)}
    assert addresses or component == "worker"
    for flag, address in addresses.items():
        host = host_of(address)
        assert host is None or ipaddress.ip_address(host).is_loopback, (flag, address)


def test_no_module_uses_pickle():
    offenders = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for n in names):
                    offenders.append(str(path.relative_to(REPO)))
    assert not offenders


def test_every_socket_has_the_size_limit():
    ctx = zmq.Context()
    try:
        for kind in (zmq.ROUTER, zmq.DEALER, zmq.PULL):
            sock = make_socket(ctx, kind)
            assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
            sock.close(0)
    finally:
        ctx.term()


def exchange(server_keys: CurveKeys, client_keys: CurveKeys | None, *, present_server_key: bytes | None = None,
             wait_s: float = 1.5) -> bytes | None:
    """Connect a DEALER to a CURVE ROUTER; return what the ROUTER received."""
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    router = make_socket(server_ctx, zmq.ROUTER, curve=server_keys)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    if client_keys is None:
        dealer = client_ctx.socket(zmq.DEALER)  # no CURVE at all
    else:
        dealer = make_socket(client_ctx, zmq.DEALER, curve=client_keys)
        if present_server_key is not None:
            dealer.curve_serverkey = present_server_key
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    try:
        return router.recv_multipart()[-1] if router.poll(int(wait_s * 1000)) else None
    finally:
        for sock in (dealer, router):
            sock.close(0)
        client_ctx.term()
        stop_authenticator(server_ctx)
        server_ctx.term()


def keys() -> CurveKeys:
    return CurveKeys.from_secret(zmq.curve_keypair()[1])


def test_curve_admits_a_peer_with_the_cluster_key():
    cluster = keys()
    assert exchange(cluster, cluster) == b"hello"


def test_curve_refuses_peers_without_the_cluster_key():
    cluster = keys()
    assert exchange(cluster, None) is None  # a plain, unauthenticated peer
    # A peer that knows the server's public key but holds another secret key.
    assert exchange(cluster, keys(), present_server_key=cluster.public) is None


def test_curve_keys_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY", raising=False)
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY_FILE", raising=False)
    assert curve_keys_from_env() is None
    public, secret = zmq.curve_keypair()
    key_file = tmp_path / "cluster.key"
    key_file.write_text(secret.decode() + "\n")
    monkeypatch.setenv("PAGEDSERVE_CURVE_SECRET_KEY_FILE", str(key_file))
    assert curve_keys_from_env() == CurveKeys(public=public, secret=secret)
    monkeypatch.setenv("PAGEDSERVE_CURVE_SECRET_KEY", "not a key")
    with pytest.raises(ValueError):
        curve_keys_from_env()


def test_curve_from_the_environment_applies_to_every_socket(monkeypatch):
    cluster = keys()
    monkeypatch.setenv("PAGEDSERVE_CURVE_SECRET_KEY", cluster.secret.decode())
    ctx = zmq.Context()
    router, dealer = make_socket(ctx, zmq.ROUTER), make_socket(ctx, zmq.DEALER)
    try:
        assert router.mechanism == dealer.mechanism == zmq.CURVE
        assert router.curve_server and not dealer.curve_server
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"over curve")
        assert router.poll(3000) and router.recv_multipart()[-1] == b"over curve"
    finally:
        for sock in (router, dealer):
            sock.close(0)
        stop_authenticator(ctx)
        ctx.term()


def test_a_tokenizer_router_with_curve_stops_on_sigterm(tmp_path):
    """compose's tokenizer-router (a router only) with the cluster key: SIGTERM
    must end it. Before, ctx.term() waited forever for the ZAP handler's
    sockets, which flooded the log with ContextTerminated tracebacks."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from local_ports import free_port

    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "tokenizer", "--tokenizer-pool-size", "0",
             "--frontend-address", f"tcp://127.0.0.1:{free_port()}",
             "--backend-address", f"tcp://127.0.0.1:{free_port()}"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PAGEDSERVE_CURVE_SECRET_KEY": keys().secret.decode()})
    try:
        deadline = time.monotonic() + 30
        while b"tokenizer router:" not in log_path.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log_path.read_text()
