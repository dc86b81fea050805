"""Overload and timeouts on a scheduler that runs one request at a time and
lets two wait (--max-num-seqs 1 --max-waiting-requests 2, 50 ms per step):
beyond the queue, HTTP 429 with Retry-After (streamed or not) and gRPC
RESOURCE_EXHAUSTED; a request outliving --request-timeout gets 504 and is
aborted."""
from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import httpx
import pytest
import zmq

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from common.protocol import EngineError, EngineOutputs, EngineRequest, MessageType
from common.sampling_params import SamplingParams
from common.transport import MessageDecoder, make_socket, recv, send
from tests.reliability.conftest import REQUEST_TIMEOUT_S
from tests.reliability.stack import MODEL_NAME


def completion(stack, max_tokens: int, *, stream: bool = False, timeout: float = 30) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": max_tokens, "stream": stream}
    return httpx.post(stack.api_url + "/completions", json=body, timeout=timeout)


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def assert_429(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == "server_overloaded" and "overloaded" in error["message"]


def test_a_full_waiting_queue_answers_429_then_recovers(slow_stack):
    slow_stack.wait_all_blocks_free()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        # One runs 60 steps, two wait behind it: the queue is full. (All three must
        # end within the 5 s request timeout, so the first cannot run much longer.)
        running = pool.submit(completion, slow_stack, 60)
        wait_until(lambda: slow_stack.stats().num_running == 1, what="the first request to run")
        queued = [pool.submit(completion, slow_stack, 3) for _ in range(2)]
        wait_until(lambda: slow_stack.stats().num_waiting == 2, what="two waiting requests")
        # Refused by the frontend once the scheduler has told it, or by the scheduler
        # itself before that: 429 either way.

        assert_429(completion(slow_stack, 3))
        streamed = completion(slow_stack, 3, stream=True)
        assert_429(streamed)  # a real status, not an error event inside a 200 stream
        with grpc.insecure_channel(slow_stack.grpc_address) as channel, pytest.raises(grpc.RpcError) as error:
            list(pb_grpc.PagedServeStub(channel).Generate(pb.GenerateRequest(
                text="one", sampling_params=pb.SamplingParams(max_tokens=2)), timeout=10))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The queue was full all along: the first request still runs, two still wait.
        stats = slow_stack.stats()
        assert (stats.num_running, stats.num_waiting) == (1, 2), stats

        # Nothing already accepted is lost.
        assert running.result().json()["usage"]["completion_tokens"] == 60
        assert all(f.result().json()["choices"][0]["text"] == slow_stack.expected_text(3) for f in queued)
    wait_until(lambda: completion(slow_stack, 2).status_code == 200, what="requests to be accepted again")
    assert "waiting queue full" in slow_stack.scheduler.log()


def test_the_scheduler_itself_refuses_beyond_its_queue(slow_stack):
    """A request that slips past the frontend's check (or comes from another
    frontend) is refused by the scheduler with status 429."""
    slow_stack.wait_all_blocks_free()
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, identity=b"raw-test-frontend", connect=slow_stack.scheduler_address)
    decoder = MessageDecoder([MessageType.ENGINE_OUTPUTS, MessageType.ENGINE_ERROR])
    try:
        params = SamplingParams(temperature=0, max_tokens=20)

        def submit(i: int) -> None:
            send(sock, EngineRequest(request_id=f"raw-{i}", prompt_token_ids=[5, 6, 7], sampling_params=params))
        submit(0)
        wait_until(lambda: slow_stack.stats().num_running == 1, what="the first request to run")
        for i in (1, 2, 3):  # two wait, the third is one too many
            submit(i)
        refused, finished = None, set()
        deadline = time.monotonic() + 15
        while len(finished) < 3 and time.monotonic() < deadline:
            if not sock.poll(500):
                continue
            msg = recv(sock, decoder)
            if isinstance(msg, EngineError):
                refused = msg
            elif isinstance(msg, EngineOutputs):
                finished.update(o.request_id for o in msg.outputs if o.finish_reason is not None)
        assert refused is not None and refused.request_id == "raw-3" and refused.status == 429
        assert finished == {"raw-0", "raw-1", "raw-2"}
    finally:
        sock.close(0)
        ctx.term()
    slow_stack.wait_all_blocks_free()


def test_a_request_past_the_timeout_gets_504_and_is_aborted(slow_stack):
    before = slow_stack.wait_all_blocks_free().num_generation_tokens
    steps = int(2 * REQUEST_TIMEOUT_S / 0.05)  # 50 ms steps: twice the request timeout
    response = completion(slow_stack, steps)
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    after = slow_stack.wait_all_blocks_free(timeout=60).num_generation_tokens
    assert 0 < after - before < steps  # aborted in the scheduler, not left running to its end


def test_a_streamed_request_past_the_timeout_ends_with_an_error_event(slow_stack):
    before = slow_stack.wait_all_blocks_free().num_generation_tokens
    body = {"model": MODEL_NAME, "prompt": "one", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", slow_stack.api_url + "/completions", json=body, timeout=30) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout" and events[-1] == "data: [DONE]"
    after = slow_stack.wait_all_blocks_free(timeout=60).num_generation_tokens
    assert 0 < after - before < 200  # aborted, not left running to its end
