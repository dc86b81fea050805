"""Workers that die (model-free workers, 50 ms per step): a standby worker
takes over the running requests, which finish exactly as without the fault;
a request that kills two workers is failed instead of killing a third."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import httpx

from polling import wait_for
from tests.reliability.conftest import HANG, POISON
from tests.reliability.stack import MODEL_NAME


def stream_completion(stack, prompt: str, max_tokens: int, chunks_seen: list) -> tuple[str, list[dict]]:
    """Stream a completion; returns (the text, any error events)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    texts, errors = [], []
    with httpx.stream("POST", stack.api_url + "/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                texts.append(event["choices"][0]["text"])
                chunks_seen.append(time.monotonic())
    return "".join(texts), errors


def wait_for_log(process, pattern: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, process.log()):
        assert time.monotonic() < deadline, f"{pattern!r} not in {process.log_path.name}:\n{process.log()[-3000:]}"
        time.sleep(0.05)


def test_a_standby_worker_takes_over_and_outputs_do_not_change(slow_stack):
    slow_stack.wait_all_blocks_free()
    log_start = len(slow_stack.scheduler.log())  # the stack and its log are shared with other tests
    first = next(w for w in slow_stack.workers if w.proc.poll() is None)  # the registered one (earlier tests kill some)
    standing_by = slow_stack.scheduler.log().count("stands by")
    slow_stack.workers.append(slow_stack.start_worker())
    wait_for(lambda: slow_stack.scheduler.log().count("stands by") > standing_by, "a standby worker")
    chunks: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream_completion, slow_stack, "one two", 30, chunks)]
        streams.append(pool.submit(stream_completion, slow_stack, "three", 12, []))  # waits behind the first
        wait_for(lambda: len(chunks) >= 8, "8 of the first request's 30 chunks")
        os.kill(first.proc.pid, signal.SIGKILL)
        results = [s.result(timeout=30) for s in streams]
    assert results[0] == (slow_stack.expected_text(30), [])
    assert results[1] == (slow_stack.expected_text(12), [])
    log = slow_stack.scheduler.log()[log_start:]  # the kill caught the request running, and it moved
    assert "lost (its connection closed): 1 running requests moved back" in log
    assert "registered and replaces the lost worker" in log
    slow_stack.wait_all_blocks_free()


def test_workers_stopped_on_purpose_cast_no_suspicion_on_their_requests(slow_stack):
    """Two SIGTERMs during one request (an operator restarting workers) are no
    crashes: the request finishes, where two crashes would have failed it."""
    slow_stack.wait_all_blocks_free()
    log_start = len(slow_stack.scheduler.log())  # the stack and its log are shared with other tests
    chunks: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_completion, slow_stack, "one two", 60, chunks)
        for round in range(2):
            stopping = slow_stack.scheduler.log().count("it is stopping")
            standing_by = slow_stack.scheduler.log().count("stands by")
            slow_stack.workers.append(slow_stack.start_worker())
            wait_for_log(slow_stack.scheduler, r"(stands by[\s\S]*){%d}" % (standing_by + 1))
            seen = len(chunks)
            wait_for(lambda: len(chunks) >= seen + 5, "5 more chunks")  # the request runs on this worker
            assert not stream.done()
            registered = next(w for w in slow_stack.workers if w.proc.poll() is None)
            os.kill(registered.proc.pid, signal.SIGTERM)
            registered.proc.wait(timeout=10)
            wait_for_log(slow_stack.scheduler, r"(it is stopping[\s\S]*){%d}" % (stopping + 1))
        assert stream.result(timeout=30) == (slow_stack.expected_text(60), [])
    assert "workers died" not in slow_stack.scheduler.log()[log_start:]
    slow_stack.wait_all_blocks_free()


def test_a_request_that_kills_two_workers_is_failed_and_the_third_serves_on(slow_stack):
    slow_stack.wait_all_blocks_free()
    standing_by = slow_stack.scheduler.log().count("stands by")
    while len([w for w in slow_stack.workers if w.proc.poll() is None]) < 3:  # one registered, two standing by
        slow_stack.workers.append(slow_stack.start_worker())
    deadline = time.monotonic() + 30
    while slow_stack.scheduler.log().count("stands by") < standing_by + 2:
        assert time.monotonic() < deadline, slow_stack.scheduler.log()[-3000:]
        time.sleep(0.05)
    body = {"model": MODEL_NAME, "prompt": f"one {POISON} two", "max_tokens": 5}
    response = httpx.post(slow_stack.api_url + "/completions", json=body, timeout=60)
    assert response.status_code == 500, response.text
    assert "died 2 times while running this request" in response.json()["error"]["message"]
    deadline = time.monotonic() + 10  # the kernel closes a dying process's sockets before it is reaped
    while len([w for w in slow_stack.workers if w.proc.poll() is None]) > 1:
        assert time.monotonic() < deadline, "two workers should have died"
        time.sleep(0.05)
    ok = httpx.post(slow_stack.api_url + "/completions", timeout=60,
                    json={"model": MODEL_NAME, "prompt": "one", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == slow_stack.expected_text(4)
    slow_stack.wait_all_blocks_free()


def test_a_hung_worker_is_given_up_after_the_step_timeout(slow_stack):
    """A worker that stays connected but returns no result for 5 s (the step
    timeout is 1 s) is treated as lost; a request that hangs two workers is
    failed; the workers recover and serve on."""
    slow_stack.wait_all_blocks_free()
    standing_by = slow_stack.scheduler.log().count("stands by")
    slow_stack.workers.append(slow_stack.start_worker())  # one registered, one standing by
    deadline = time.monotonic() + 30
    while slow_stack.scheduler.log().count("stands by") <= standing_by:
        assert time.monotonic() < deadline, slow_stack.scheduler.log()[-3000:]
        time.sleep(0.05)
    body = {"model": MODEL_NAME, "prompt": f"one {HANG} two", "max_tokens": 5}
    response = httpx.post(slow_stack.api_url + "/completions", json=body, timeout=60)
    # 500, not the 504 of the 5 s request timeout: given up after the 1 s step timeout
    assert response.status_code == 500, response.text
    assert "no result for step" in slow_stack.scheduler.log()
    # Both workers sleep out their 5 s hang, then register again; a request sent
    # before that would wait for a worker and could meet the 5 s request timeout.
    replaced = slow_stack.scheduler.log().count("registered and replaces the lost worker")
    deadline = time.monotonic() + 30
    while slow_stack.scheduler.log().count("registered and replaces the lost worker") <= replaced:
        assert time.monotonic() < deadline, slow_stack.scheduler.log()[-3000:]
        time.sleep(0.05)
    ok = httpx.post(slow_stack.api_url + "/completions", timeout=60,
                    json={"model": MODEL_NAME, "prompt": "one", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == slow_stack.expected_text(4)
    slow_stack.wait_all_blocks_free()
