"""A scheduler that loses a frontend's requests while the frontend lives: the
frontend resubmits them and clients see only a pause. Model-free stacks (real
frontend, tokenizer pool and scheduler processes, a scripted worker); the
killed-scheduler case with the real model is in test_real_faults."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from polling import wait_for
from tests.reliability.clients import stream_completion
from tests.reliability.stack import MODEL_NAME, Process, Stack


@pytest.fixture
def stack(tmp_path):
    # The scheduler gives up on a frontend silent for 2.5 s (its heartbeat is every second: a
    # 1 s timeout gave up on live frontends of a loaded machine); one request runs at a time and
    # one more may wait.
    stack = Stack(tmp_path, step_delay=0.05, scheduler_args=["--frontend-timeout", "2.5", "--max-num-seqs", "1",
                                                             "--max-waiting-requests", "1"])
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.stop()


def submit_two(pool: concurrent.futures.Executor, stack: Stack, body: dict) -> list[concurrent.futures.Future]:
    """Two streamed completions, one after the other: arriving together, the second could find
    the first still in the one-place waiting queue and get a 429."""
    futures = [pool.submit(stream_completion, stack.base_url, body)]
    wait_for(lambda: stack.stats().num_running == 1, "the first request to run")
    return futures + [pool.submit(stream_completion, stack.base_url, body)]


def test_a_frontend_the_scheduler_gave_up_on_resubmits_its_requests(stack):
    # 200 tokens (10 s) each: neither finishes before the scheduler gives up on the frontend.
    body = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": 200}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = submit_two(pool, stack, body)
        wait_for(lambda: stack.stats().num_running + stack.stats().num_waiting == 2, "both requests to arrive")
        os.kill(stack.frontend.proc.pid, signal.SIGSTOP)  # silent, its connection still up
        try:
            stack.scheduler.wait_for_log(r"silent for \ds: aborting its 2 requests", timeout=30)
        finally:
            os.kill(stack.frontend.proc.pid, signal.SIGCONT)
        results = [f.result() for f in futures]
    assert all(r.ok and r.finish_reason == "length" for r in results), results
    assert [r.text for r in results] == [stack.expected_text(200)] * 2
    stack.frontend.wait_for_log("the scheduler dropped 2 of this frontend's requests")
    stack.wait_all_blocks_free()


def test_a_restarted_scheduler_gets_the_requests_of_the_one_that_died(stack):
    """Both, though its waiting queue holds one: a resubmission was accepted once already."""
    body = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": 60}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = submit_two(pool, stack, body)
        wait_for(lambda: stack.stats().num_generation_tokens >= 20 and stack.stats().num_waiting == 1,
                 "one request to be mid-generation, the other waiting")
        stack.scheduler.stop(signal.SIGKILL)
        time.sleep(1.0)  # what a supervisor's restart backoff would take
        stack.scheduler = Process("pagedserve.cli", stack.scheduler.proc.args[3:], stack.tmp / "scheduler2.log")
        results = [f.result() for f in futures]
    assert all(r.ok for r in results), results
    assert [r.text for r in results] == [stack.expected_text(60)] * 2
    stack.frontend.wait_for_log("resubmitting 2 in-flight requests")
    stack.wait_all_blocks_free()
