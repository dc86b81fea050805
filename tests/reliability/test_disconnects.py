"""Clients and frontends that vanish mid-request: their requests are aborted
and their KV blocks freed within a step or two (50 ms steps here), and
nobody else notices."""
from __future__ import annotations

import concurrent.futures
import os
import signal

import grpc
import httpx
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from polling import wait_for
from tests.reliability.stack import MODEL_NAME, wait_all_blocks_free, wait_healthy

LONG = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": 90}  # 90 steps: 4.5 s


def first_chunk_then_hang_up(base_url: str, body: dict) -> None:
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return  # leaving the block closes the connection


def generated_tokens(stack) -> int:
    return stack.wait_all_blocks_free().num_generation_tokens


def assert_aborted(stack, before: int) -> None:
    """The request's blocks came back, and it stopped short of its 90 tokens:
    it was aborted, not left to run to its end."""
    after = stack.wait_all_blocks_free(timeout=60).num_generation_tokens
    assert 0 < after - before < LONG["max_tokens"], (before, after)


def test_http_stream_disconnect_frees_blocks(slow_stack):
    before = generated_tokens(slow_stack)
    first_chunk_then_hang_up(slow_stack.base_url, LONG)
    assert_aborted(slow_stack, before)


def test_http_non_streamed_disconnect_frees_blocks(slow_stack):
    before = generated_tokens(slow_stack)
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes its connection
        httpx.post(slow_stack.api_url + "/completions", json=LONG, timeout=0.5)
    assert_aborted(slow_stack, before)


@pytest.mark.parametrize("request_id", ["", "job#1"])  # the second looks like the id of a sample
def test_grpc_cancel_frees_blocks(slow_stack, request_id):
    before = generated_tokens(slow_stack)
    with grpc.insecure_channel(slow_stack.grpc_address) as channel:
        call = pb_grpc.PagedServeStub(channel).Generate(pb.GenerateRequest(
            request_id=request_id, text="one two", sampling_params=pb.SamplingParams(max_tokens=90)), timeout=30)
        next(call)
        call.cancel()
    assert_aborted(slow_stack, before)


def test_a_killed_frontend_has_its_requests_aborted_and_others_carry_on(slow_stack):
    """Two frontends on one scheduler; SIGKILL one while its request runs and
    another frontend's request waits behind it."""
    before = generated_tokens(slow_stack)
    second = slow_stack.start_frontend("frontend-2")
    try:
        base_url, _ = slow_stack.frontend_urls(second)
        wait_healthy(base_url)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            doomed = pool.submit(lambda: httpx.post(base_url + "/v1/completions", json=LONG, timeout=60))
            wait_for(lambda: slow_stack.stats().num_running == 1, "the doomed request to run")
            survivor = pool.submit(lambda: httpx.post(slow_stack.api_url + "/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": "one", "max_tokens": 5}))
            wait_for(lambda: slow_stack.stats().num_waiting == 1, "the survivor to wait behind it")
            os.kill(second.proc.pid, signal.SIGKILL)
            reply = survivor.result(timeout=30)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == slow_stack.expected_text(5)
            assert isinstance(doomed.exception(timeout=30), httpx.TransportError)
        after = wait_all_blocks_free(slow_stack.stats, timeout=60).num_generation_tokens
        assert after - before < LONG["max_tokens"] + 5  # the doomed request was aborted, not run to its end
        assert "disconnected: aborting its 1 requests" in slow_stack.scheduler.log()
    finally:
        second.stop()
