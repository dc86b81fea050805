"""The scheduler's gRPC control service: a bearer token (the API key, or one derived
from the CURVE cluster key) on every call but Health, and TLS only when given
--ssl-*; open as before with neither. Real grpc servers and clients throughout,
and a real `pagedserve scheduler` process."""
from __future__ import annotations

import asyncio
import sys
from concurrent import futures

import grpc
import pytest
import zmq

from common.control_token import accepted_tokens, bearer_matches, client_token, curve_control_token
from common.grpc_gen import control_pb2, control_pb2_grpc
from common.tls_files import TlsFiles
from common.transport import CurveKeys
from frontend.engine.control_client import ControlClient
from local_ports import free_port
from logged_process import LoggedProcess
from scheduler.control import ControlState, SchedulerControlServicer, start_control_server
from self_signed import self_signed_certificate

API_KEY = "sk-control-7d1e"
GATED = ["GetStats", "GetModelInfo", "ResetPrefixCache"]


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    """A certificate for a name the clients never dial: they check the certificate's own name."""
    key, cert = self_signed_certificate(tmp_path_factory.mktemp("control-tls"), "scheduler.example",
                                        "DNS:scheduler.example")
    return TlsFiles(str(key), str(cert))


@pytest.fixture()
def no_curve(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY", raising=False)
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY_FILE", raising=False)


def _reset_done() -> "futures.Future[bool]":
    done: futures.Future[bool] = futures.Future()
    done.set_result(True)
    return done


def serve(address: str, *, tokens: list[str] = (), tls: TlsFiles | None = None) -> grpc.Server:
    servicer = SchedulerControlServicer(ControlState(), "tiny-model", _reset_done)
    return start_control_server(address, servicer, tokens=list(tokens), tls=tls)


@pytest.fixture()
def server_with(tmp_path):
    """serve(...) on a free TCP port (or a Unix socket with unix=True); the address."""
    servers = []

    def start(*, unix: bool = False, **options) -> str:
        address = f"unix:{tmp_path}/control" if unix else f"127.0.0.1:{free_port()}"
        servers.append(serve(address, **options))
        return address

    yield start
    for server in servers:
        server.stop(grace=None)


def call(channel: grpc.Channel, method: str, authorization: str | None = None):
    metadata = None if authorization is None else [("authorization", authorization)]
    return getattr(control_pb2_grpc.SchedulerControlStub(channel), method)(control_pb2.Empty(), timeout=10,
                                                                             metadata=metadata)


def tls_channel(address: str, tls: TlsFiles) -> grpc.Channel:
    credentials, options = tls.client_credentials()
    return grpc.secure_channel(address, credentials, options=options)


def test_without_a_secret_the_service_stays_open(server_with, no_curve):
    address = server_with(tokens=accepted_tokens(None))
    with grpc.insecure_channel(address) as channel:
        assert call(channel, "GetStats") is not None
        assert call(channel, "ResetPrefixCache").ok


@pytest.mark.parametrize("authorization", [None, "", "Bearer", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}",
                                           API_KEY, f"Basic {API_KEY}"])
@pytest.mark.parametrize("method", GATED)
def test_a_call_without_the_key_is_unauthenticated(server_with, authorization, method):
    address = server_with(tokens=[API_KEY])
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
        call(channel, method, authorization)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <token>" in error.value.details()


def test_health_stays_open_and_the_key_lets_every_call_in(server_with):
    address = server_with(tokens=[API_KEY])
    with grpc.insecure_channel(address) as channel:
        assert call(channel, "Health").message  # no key: open for probes
        key = f"Bearer {API_KEY}"
        assert call(channel, "GetStats", key) is not None
        assert call(channel, "ResetPrefixCache", f"bearer  {API_KEY}").ok  # the scheme is case-insensitive
        with pytest.raises(grpc.RpcError) as error:  # past the gate: the servicer's own answer
            call(channel, "GetModelInfo", key)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_curve_derived_token(server_with, monkeypatch):
    keys = CurveKeys.from_secret(zmq.curve_keypair()[1])
    monkeypatch.setenv("PAGEDSERVE_CURVE_SECRET_KEY", keys.secret.decode())
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY_FILE", raising=False)
    token = client_token(None)
    assert token == curve_control_token(keys) and keys.secret.decode() not in token and len(token) == 64
    # The scheduler accepts the derived token and its API key; a client with both sends the derived one
    # (every component of a CURVE deployment has the cluster key, the API key maybe only the frontend).
    assert client_token(API_KEY) == token
    address = server_with(tokens=accepted_tokens(API_KEY))
    with grpc.insecure_channel(address) as channel:
        assert call(channel, "GetStats", f"Bearer {token}") is not None
        assert call(channel, "GetStats", f"Bearer {API_KEY}") is not None
        for wrong in (keys.secret.decode(), curve_control_token(CurveKeys.from_secret(zmq.curve_keypair()[1]))):
            with pytest.raises(grpc.RpcError) as error:  # never the secret itself, nor another cluster's token
                call(channel, "GetStats", f"Bearer {wrong}")
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_bearer_matches_any_accepted_token():
    assert bearer_matches("Bearer b", ["a", "b"]) and not bearer_matches("Bearer c", ["a", "b"])
    assert not bearer_matches("Bearer ", ["a"]) and not bearer_matches(None, ["a"])


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix-socket"])
def test_with_tls_only_tls_clients_that_trust_the_certificate_get_in(server_with, tls, unix, tmp_path):
    address = server_with(unix=unix, tokens=[API_KEY], tls=tls)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
        call(channel, "Health")  # plaintext: refused at the handshake
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    with tls_channel(address, tls) as channel:
        assert call(channel, "Health").message
        assert call(channel, "GetStats", f"Bearer {API_KEY}") is not None
        with pytest.raises(grpc.RpcError) as error:  # TLS is no substitute for the key
            call(channel, "GetStats")
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    other_key, other_cert = self_signed_certificate(tmp_path, "scheduler.example", "DNS:scheduler.example")
    with tls_channel(address, TlsFiles(str(other_key), str(other_cert))) as channel, \
            pytest.raises(grpc.RpcError) as error:  # a certificate the client does not trust
        call(channel, "Health")
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_frontends_control_client_sends_the_token_over_tls(server_with, tls):
    address = server_with(unix=True, tokens=[API_KEY], tls=tls)

    async def calls(**options):
        client = ControlClient(address, **options)
        try:
            return await client.health(), await client.stats()
        finally:
            await client.close()

    health, stats = asyncio.run(calls(token=API_KEY, tls=tls))
    assert health is not None and stats is not None
    health, stats = asyncio.run(calls(tls=tls))  # no token: Health only
    assert health is not None and stats is None
    assert asyncio.run(calls(token=API_KEY)) == (None, None)  # no TLS: nothing


def test_a_scheduler_process_with_a_key_and_tls(tmp_path, tls):
    """`pagedserve scheduler` takes the key from its environment (never its command line)
    and --ssl-* from flags: plain clients are refused, TLS clients need the key."""
    address = f"127.0.0.1:{free_port()}"
    scheduler = LoggedProcess([sys.executable, "-m", "pagedserve.cli", "scheduler", "--model", "tiny-model",
                               "--device", "cpu", "--scheduler-address", f"tcp://127.0.0.1:{free_port()}",
                               "--worker-address", f"tcp://127.0.0.1:{free_port()}",
                               "--scheduler-control-address", address, "--disable-log-stats",
                               "--ssl-keyfile", tls.keyfile, "--ssl-certfile", tls.certfile],
                              tmp_path / "scheduler.log", env={"PAGEDSERVE_API_KEY": API_KEY, "PAGEDSERVE_LOG_LEVEL": "INFO",
                                                               "PAGEDSERVE_CURVE_SECRET_KEY": ""},
                              name="scheduler")
    try:
        scheduler.wait_for_log(r"control 127\.0\.0\.1:\d+ \(TLS\); token required", timeout=60)
        assert API_KEY not in open(f"/proc/{scheduler.proc.pid}/cmdline", "rb").read().decode(errors="replace")
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError):
            call(channel, "Health")
        with tls_channel(address, tls) as channel:
            assert call(channel, "Health").message == "waiting for a worker"
            with pytest.raises(grpc.RpcError) as error:
                call(channel, "GetStats")
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert call(channel, "GetStats", f"Bearer {API_KEY}") is not None
    finally:
        assert scheduler.stop() == 0, scheduler.log()[-3000:]
    assert "refused a control call to /pagedserve.control.v1.SchedulerControl/GetStats" in scheduler.log()


def test_the_control_client_warns_once_of_a_misconfiguration(server_with, tls, caplog):
    """A frontend with --ssl-* before a scheduler without (or a wrong token): one warning
    naming the cause, not one per /health or /metrics."""
    plain, gated = server_with(), server_with(tokens=[API_KEY])

    async def twice(address: str, call: str, **options) -> None:
        client = ControlClient(address, **options)
        try:
            for _ in range(2):
                await getattr(client, call)()
        finally:
            await client.close()

    with caplog.at_level("DEBUG", logger="frontend.engine.control_client"):
        asyncio.run(twice(plain, "health", tls=tls))
        asyncio.run(twice(gated, "stats", token="wrong"))
    warnings = [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and r.name == "frontend.engine.control_client"]
    assert len(warnings) == 2, warnings
    assert "handshake failed" in warnings[0].lower() and "UNAUTHENTICATED" in warnings[1]
