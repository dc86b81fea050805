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


def test_a_request_still_waiting_for_the_tokenizer_pool_also_ends_with_503(server, tmp_path):
    """The tokenizer pool is down (being restarted) when the frontend is stopped:
    the request waiting for its prompt's tokens gets the same clear 503, not a
    500 from uvicorn cancelling it (with a traceback in the log)."""
    from local_ports import free_port

    args = list(server.frontend_args)
    args[args.index("--tokenizer-address") + 1] = f"tcp://127.0.0.1:{free_port()}"  # nobody answers there
    frontend, base_url, grpc_address = start_frontend(args, tmp_path / "frontend.log")
    channel = grpc.insecure_channel(grpc_address)
    try:
        with httpx.Client(timeout=60) as client:
            import concurrent.futures
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                http_reply = pool.submit(client.post, base_url + "/v1/completions",
                                         json={"prompt": "Hello", "max_tokens": 2})
                grpc_reply = pool.submit(lambda: list(pagedserve_pb2_grpc.PagedServeStub(channel).Generate(
                    pb.GenerateRequest(text="Hello"), timeout=60)))
                frontend.wait_for_log("no reply to tokenizer job")
                frontend.proc.send_signal(signal.SIGTERM)
                response = http_reply.result()
                with pytest.raises(grpc.RpcError) as ended:
                    grpc_reply.result()
        assert response.status_code == 503, response.text
        assert response.json()["error"]["message"] == SHUTTING_DOWN
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in ended.value.details()
        assert frontend.proc.wait(15) == 0
        assert "Traceback" not in frontend.log()
    finally:
        channel.close()
        frontend.stop()
