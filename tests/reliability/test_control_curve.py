"""A CURVE deployment (every component given the cluster key) guards the scheduler's
control service with the token derived from that key: the frontend sends it (its
/health, /metrics and requests work), a client without it is refused."""
from __future__ import annotations

import grpc
import httpx
import pytest
import zmq

from common.control_token import client_token
from common.grpc_gen import control_pb2, control_pb2_grpc
from tests.reliability.stack import MODEL_NAME, Stack


def test_the_frontend_uses_the_control_service_with_the_curve_token(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CURVE_SECRET_KEY", zmq.curve_keypair()[1].decode())
    monkeypatch.delenv("PAGEDSERVE_CURVE_SECRET_KEY_FILE", raising=False)
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    stack = Stack(tmp_path)
    try:
        stack.wait_healthy()
        reply = httpx.post(stack.api_url + "/completions", json={"model": MODEL_NAME, "prompt": "one two",
                                                                 "max_tokens": 4}, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text
        metrics = httpx.get(stack.base_url + "/metrics", timeout=30).text
        assert "pagedserve:num_requests_running" in metrics and "pagedserve:kv_cache_usage_perc" in metrics
        with grpc.insecure_channel(stack.control_address) as channel:
            stub = control_pb2_grpc.SchedulerControlStub(channel)
            assert stub.Health(control_pb2.Empty(), timeout=10).worker_ready
            with pytest.raises(grpc.RpcError) as error:
                stub.GetStats(control_pb2.Empty(), timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stats = stub.GetStats(control_pb2.Empty(), timeout=10,
                                  metadata=[("authorization", f"Bearer {client_token(None)}")])
            assert stats.num_blocks > 0
        assert "GetStats failed" not in stack.frontend.log() and "GetModelInfo failed" not in stack.frontend.log()
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
