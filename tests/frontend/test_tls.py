"""--ssl-keyfile / --ssl-certfile (vLLM's flags): the frontend serves HTTPS, and
gRPC over TLS with the same key; plain connections are refused, and a missing
file stops startup with one clear line."""
from __future__ import annotations

import subprocess

import grpc
import httpx
import openai
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.tls_files import TlsFiles
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from local_ports import free_port
from self_signed import self_signed_certificate
from test_cli_errors import assert_clear_error, run
from tests.frontend.conftest import start_frontend
from tests.frontend.fakes import FakeControl


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (and localhost)."""
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_frontend(server, certificate, tmp_path_factory):
    """A frontend with TLS, whose control client then speaks TLS too: to a control
    service serving the same certificate (as `serve` and its scheduler do)."""
    key, cert = certificate
    control = FakeControl(server.control.max_model_len, server.control.vocab_size).start(
        f"127.0.0.1:{free_port()}", TlsFiles(str(key), str(cert)).server_credentials())
    args = list(server.frontend_args)
    args[args.index("--scheduler-control-address") + 1] = control.address
    frontend, base_url, grpc_address = start_frontend(
        [*args, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
        tmp_path_factory.mktemp("tls-frontend") / "frontend.log")
    yield base_url, grpc_address
    frontend.stop()
    control.stop()


def test_https_with_the_openai_client(tls_frontend, certificate):
    base_url, _ = tls_frontend
    assert base_url.startswith("https://")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(verify=str(certificate[1])))
    reply = client.completions.create(model="tiny-model", prompt="Say hello", max_tokens=3)
    assert reply.usage.completion_tokens == 3
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the same port is refused
        httpx.get(base_url.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # and so is a certificate the client does not trust
        httpx.get(base_url + "/health", timeout=5)


def test_grpc_over_tls(tls_frontend, certificate):
    _, grpc_address = tls_frontend
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate[1].read_bytes())
    with grpc.secure_channel(grpc_address, credentials) as channel:
        assert pb_grpc.PagedServeStub(channel).Health(pb.HealthRequest(), timeout=10).ok
    with grpc.insecure_channel(grpc_address) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.PagedServeStub(channel).Health(pb.HealthRequest(), timeout=5)


@pytest.mark.parametrize("command", ["frontend", "serve"])
def test_a_missing_key_or_certificate_stops_startup(command, certificate):
    code, output = run([command, "--ssl-keyfile", "/no/such/key.pem", "--ssl-certfile", str(certificate[1])])
    assert code == 2
    assert_clear_error(code, output, "--ssl-keyfile", "/no/such/key.pem")
    code, output = run([command, "--ssl-certfile", str(certificate[1])])
    assert_clear_error(code, output, "--ssl-keyfile and --ssl-certfile go together")


def test_serve_hands_the_files_on_by_absolute_path(tmp_path, certificate, monkeypatch):
    from pagedserve.serve import build_parser, component_commands
    from frontend.frontend_cli import build_parser as frontend_parser
    from scheduler.scheduler_cli import build_parser as scheduler_parser

    key, cert = certificate
    monkeypatch.chdir(key.parent)
    args = build_parser().parse_args(["--ssl-keyfile", key.name, "--ssl-certfile", cert.name])
    components = {c.name: c for c in component_commands(args, str(tmp_path))}
    parsed = frontend_parser().parse_args(components["frontend"].argv[1:])
    assert (parsed.ssl_keyfile, parsed.ssl_certfile) == (str(key), str(cert))
    # And to the scheduler: its control service speaks TLS with the same files.
    parsed = scheduler_parser().parse_args(components["scheduler"].argv[1:])
    assert (parsed.ssl_keyfile, parsed.ssl_certfile) == (str(key), str(cert))


@pytest.mark.parametrize("command", ["frontend", "serve"])
def test_a_key_or_certificate_that_cannot_be_used_stops_startup(command, certificate, tmp_path):
    """A file that is not PEM, or a key of another certificate, is one line at startup:
    not grpc's C++ errors, a misleading "port in use" and a frontend restart loop."""
    key, cert = certificate
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    other_key = tmp_path / "other-key.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other_key), "2048"], check=True, capture_output=True)
    for files in ([key, not_pem], [not_pem, cert], [other_key, cert]):
        code, output = run([command, "--ssl-keyfile", str(files[0]), "--ssl-certfile", str(files[1])], timeout=30)
        assert code == 2, output
        assert_clear_error(code, output, "cannot use --ssl-keyfile", str(files[0]))
