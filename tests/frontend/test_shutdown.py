"""SIGTERM to a frontend (ops restarting it): requests in flight finish within
the drain period or end with a clear 503; nothing is cut off mid-body."""
import json
import signal

import grpc
import httpx
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc
from frontend.graceful_shutdown import SHUTTING_DOWN
from tests.frontend.conftest import start_frontend


def data_lines(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def endless_prompt(server) -> list[int]:
    return [server.slow_token, 5, 6]  # the fake scheduler streams it every 50 ms, forever unless capped


def test_sigterm_drains_then_ends_what_still_runs(server, tmp_path):
    frontend, base_url, grpc_address = start_frontend(server.frontend_args, tmp_path / "frontend.log")
    slow = endless_prompt(server)
    first_request = len(server.scheduler.snapshot().requests)
    channel = grpc.insecure_channel(grpc_address)
    try:
        endless_grpc = pagedserve_pb2_grpc.PagedServeStub(channel).Generate(
            pb.GenerateRequest(request_id="grpc-endless", token_ids=pb.TokenIds(ids=slow)), timeout=60)
        next(endless_grpc)
        with httpx.stream("POST", base_url + "/v1/completions", timeout=60,
                          json={"prompt": slow, "max_tokens": None, "stream": True}) as endless, \
                httpx.stream("POST", base_url + "/v1/completions", timeout=60,
                             json={"prompt": slow, "max_tokens": 20, "stream": True}) as finite:
            assert endless.status_code == finite.status_code == 200
            frontend.proc.send_signal(signal.SIGTERM)
            frontend.wait_for_log("Shutting down")

            # Within the drain period: a request that ends soon ends normally ...
            finite_events = data_lines(finite)
            assert finite_events[-1] == "[DONE]"
            assert json.loads(finite_events[-2])["choices"][0]["finish_reason"] == "length"
            # ... and nothing new gets in.
            with pytest.raises(httpx.ConnectError):
                httpx.post(base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)

            # After it: an endless request ends with an error event and [DONE], not a cut body.
            endless_events = data_lines(endless)
        assert endless_events[-1] == "[DONE]"
        error = json.loads(endless_events[-2])["error"]
        assert (error["message"], error["code"]) == (SHUTTING_DOWN, 503)
        with pytest.raises(grpc.RpcError) as ended:
            list(endless_grpc)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in ended.value.details()

        assert frontend.proc.wait(15) == 0
        # The scheduler was told to drop both endless requests.
        endless_ids = [r.request_id for r in server.scheduler.snapshot().requests[first_request:]
                       if r.sampling_params.max_tokens is None]
        assert len(endless_ids) == 2
        assert server.scheduler.wait_for(lambda received: set(endless_ids) <= set(received.aborts))
    finally:
        channel.close()
        frontend.stop()


def test_a_grpc_stream_alone_also_ends_with_unavailable(server, tmp_path):
    frontend, _, grpc_address = start_frontend(server.frontend_args, tmp_path / "frontend.log")
    channel = grpc.insecure_channel(grpc_address)
    try:
        stream = pagedserve_pb2_grpc.PagedServeStub(channel).Generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=endless_prompt(server))), timeout=60)
        next(stream)
        frontend.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:
            list(stream)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in ended.value.details()
        assert frontend.proc.wait(15) == 0
    finally:
        channel.close()
        frontend.stop()
