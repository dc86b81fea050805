"""Clients and frontends that vanish mid-request: their requests are aborted
and their KV blocks freed within a step or two (50 ms steps here), and
nobody else notices."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import httpx
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from tests.reliability.stack import MODEL_NAME, wait_all_blocks_free, wait_healthy

LONG = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": 90}  # 90 steps: 4.5 s


def first_chunk_then_hang_up(base_url: str, body: dict) -> None:
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return  # leaving the block closes the connection


def test_http_stream_disconnect_frees_blocks(slow_stack):
    slow_stack.wait_all_blocks_free()
    first_chunk_then_hang_up(slow_stack.base_url, LONG)
    hung_up = time.monotonic()
    slow_stack.wait_all_blocks_free(timeout=1.0)
    assert time.monotonic() - hung_up < 1.0


def test_http_non_streamed_disconnect_frees_blocks(slow_stack):
    slow_stack.wait_all_blocks_free()
    try:
        httpx.post(slow_stack.api_url + "/completions", json=LONG, timeout=0.5)
    except httpx.TimeoutException:
        pass  # the client gives up and closes its connection
    slow_stack.wait_all_blocks_free(timeout=1.0)


@pytest.mark.parametrize("request_id", ["", "job#1"])  # the second looks like the id of a sample
def test_grpc_cancel_frees_blocks(slow_stack, request_id):
    slow_stack.wait_all_blocks_free()
    with grpc.insecure_channel(slow_stack.grpc_address) as channel:
        call = pb_grpc.PagedServeStub(channel).Generate(pb.GenerateRequest(
            request_id=request_id, text="one two", sampling_params=pb.SamplingParams(max_tokens=90)), timeout=30)
        next(call)
        call.cancel()
    slow_stack.wait_all_blocks_free(timeout=1.0)


def test_a_killed_frontend_has_its_requests_aborted_and_others_carry_on(slow_stack):
    """Two frontends on one scheduler; SIGKILL one while its request runs and
    another frontend's request waits behind it."""
    slow_stack.wait_all_blocks_free()
    second = slow_stack.start_frontend("frontend-2")
    try:
        base_url, _ = slow_stack.frontend_urls(second)
        wait_healthy(base_url)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            doomed = pool.submit(lambda: httpx.post(base_url + "/v1/completions", json=LONG, timeout=60))
            deadline = time.monotonic() + 10
            while slow_stack.stats().num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            survivor = pool.submit(lambda: httpx.post(slow_stack.api_url + "/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": "one", "max_tokens": 5}))
            time.sleep(0.3)
            os.kill(second.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            # The doomed request is aborted at once, so the survivor runs next, long before 4.5 s.
            reply = survivor.result(timeout=30)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == slow_stack.expected_text(5)
            assert time.monotonic() - killed < 2.0
            assert isinstance(doomed.exception(timeout=30), httpx.TransportError)
        wait_all_blocks_free(slow_stack.stats, timeout=2.0)
        assert "disconnected: aborting its 1 requests" in slow_stack.scheduler.log()
    finally:
        second.stop()
