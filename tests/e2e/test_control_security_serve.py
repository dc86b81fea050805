"""`pagedserve serve --api-key ... --ssl-*` hands the key (through the environment) and
the TLS files to the scheduler too: its control service, on a Unix socket in the
runtime directory, serves TLS only and needs the key, and the frontend (which
has both) still answers /health, /metrics and requests."""
from __future__ import annotations

import ssl

import grpc
import httpx
import openai
import pytest

from common.grpc_gen import control_pb2, control_pb2_grpc
from common.tls_files import TlsFiles
from self_signed import self_signed_certificate
from serve_helpers import MODEL, cmdline, running_server

API_KEY = "sk-serve-control-51c0"


def test_serve_hands_the_key_to_the_scheduler_through_its_environment(tmp_path, monkeypatch):
    from pagedserve.serve import build_parser, component_commands

    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    args = build_parser().parse_args(["--api-key", API_KEY, "--data-parallel-size", "2"])
    components = {c.name: c for c in component_commands(args, str(tmp_path))}
    for name in ("scheduler-dp0", "scheduler-dp1", "frontend"):
        assert components[name].env.get("PAGEDSERVE_API_KEY") == API_KEY
        assert API_KEY not in components[name].argv
    assert "PAGEDSERVE_API_KEY" not in components["worker-dp0"].env


def test_serve_with_a_key_and_tls_protects_the_control_service(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY", raising=False)
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY_FILE", raising=False)
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    key, cert = self_signed_certificate(tmp_path)
    with running_server(tmp_path, ["--api-key", API_KEY, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                                   "--tokenizer-pool-size", "1", "--enforce-eager"]) as server:
        base_url = server.base_url.replace("http://", "https://")
        http = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60)
        assert http.get(base_url + "/health").status_code == 200
        metrics = http.get(base_url + "/metrics").text
        assert "pagedserve:num_requests_running" in metrics and "pagedserve:kv_cache_usage_perc" in metrics
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, http_client=http)
        reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
        assert reply.usage.completion_tokens == 4

        address = f"unix:{server.runtime_dir}/control"
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError):
            control_pb2_grpc.SchedulerControlStub(channel).Health(control_pb2.Empty(), timeout=10)
        credentials, options = TlsFiles(str(key), str(cert)).client_credentials()
        with grpc.secure_channel(address, credentials, options=options) as channel:
            stub = control_pb2_grpc.SchedulerControlStub(channel)
            assert stub.Health(control_pb2.Empty(), timeout=10).worker_ready
            with pytest.raises(grpc.RpcError) as error:
                stub.GetStats(control_pb2.Empty(), timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stats = stub.GetStats(control_pb2.Empty(), timeout=10, metadata=[("authorization", f"Bearer {API_KEY}")])
            assert stats.num_blocks > 0
        pids = server.component_pids()
        assert pids.get("scheduler") and pids.get("frontend")
        for pid in [pid for group in pids.values() for pid in group]:
            assert API_KEY not in cmdline(pid)
        assert "GetStats failed" not in server.log() and "GetModelInfo failed" not in server.log()
