"""Faults injected into a real `pagedserve serve` (SmolLM2, float32): each
test kills, by PID, a child process of the server it started, and checks
what clients see and that no KV block leaks. One server serves the module;
the scheduler is killed last."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import httpx
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from local_ports import free_port
from polling import wait_for
from serve_helpers import MODEL, REPO, cmdline, running_server
from tests.reliability.clients import many_streams, scheduler_stats, stream_completion
from tests.reliability.stack import wait_all_blocks_free, wait_healthy

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "In 1492, Columbus", "Water boils at", "My favourite food is", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Eager: a compiled model step would make every (re)start of the worker take longer.
    args = ["--kv-cache-memory", "512MiB", "--disable-log-stats", "--enforce-eager"]
    with running_server(tmp_path_factory.mktemp("faults"), args) as srv:
        yield srv


def control(server) -> str:
    return f"unix:{server.runtime_dir}/control"


def all_blocks_free(server, timeout: float = 5.0):
    return wait_all_blocks_free(lambda: scheduler_stats(control(server)), timeout)


def greedy(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def sixteen_prompts() -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]}{' and' * (i // len(PROMPTS))}" for i in range(16)]


def test_worker_killed_mid_stream_all_requests_finish_identically(server):
    bodies = [greedy(p, 12) for p in sixteen_prompts()]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        expected = list(pool.map(lambda b: stream_completion(server.base_url, b), bodies))
    assert all(r.ok for r in expected), expected

    worker_pid = server.component_pids()["worker"][0]
    chunks_seen = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_completion, server.base_url, b, on_chunk=lambda r: chunks_seen.release())
                   for b in bodies]
        for _ in range(16 * 4):  # mid-generation: ~4 of 12 tokens per request streamed
            assert chunks_seen.acquire(timeout=120)
        os.kill(worker_pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [r.errors for r in results] == [[]] * 16
    assert [r.text for r in results] == [r.text for r in expected]
    assert all(r.ok and r.finish_reason == "length" for r in results)
    log = server.log()
    assert f"worker (pid {worker_pid}) was killed by SIGKILL; restarting" in log
    assert "registered and replaces the lost worker" in log
    assert server.component_pids()["worker"][0] != worker_pid
    all_blocks_free(server)


def test_tokenizer_process_killed_under_load_fails_no_request(server):
    workers = [p for p in server.component_pids()["tokenizer"] if cmdline(p) != "pagedserve: tokenizer"]
    assert len(workers) >= 2

    def chat(i: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say the number {i}. " * (1 + i % 5)}],
                "max_tokens": 1, "temperature": 0}
        return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120).status_code

    log_start = len(server.log())
    # The victim is stopped first: the router hands it one job (each idle worker
    # gets one before either gets a second) that it never answers, so once two
    # requests are done it holds a job. It leaves the pool with that job either
    # when killed or, if the machine is slow enough that this takes longer than the
    # router's 5 s liveness timeout, as silent: either way its job is re-dispatched.
    os.kill(workers[0], signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(chat, i) for i in range(32)]
        try:
            wait_for(lambda: sum(f.done() for f in futures) >= 2, "two requests to finish", timeout=120)
        finally:
            os.kill(workers[0], signal.SIGKILL)  # never leave it stopped
        statuses = [f.result() for f in futures]
    assert statuses == [200] * 32
    wait_for(lambda: "restarting tokenizer worker" in server.log()[log_start:], "the tokenizer worker to restart")
    assert re.search(r"left the pool \((process exited|silent for more than 5s)\); re-dispatching 1 job\(s\)",
                     server.log()[log_start:]), server.log()[log_start:][-3000:]


def test_clients_that_go_away_have_their_requests_aborted(server):
    """Aborted, not run to the end: the blocks come back with fewer than the 400 tokens generated."""
    before = all_blocks_free(server).num_generation_tokens
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**greedy("Once upon a time", 400),
                                                                         "stream": True}, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    after = all_blocks_free(server, timeout=120).num_generation_tokens
    assert 0 < after - before < 400
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = pb_grpc.PagedServeStub(channel).Generate(pb.GenerateRequest(
            text="Once upon a time", sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True)), timeout=60)
        next(call)
        call.cancel()
    before, after = after, all_blocks_free(server, timeout=120).num_generation_tokens
    assert 0 < after - before < 400


def start_second_frontend(server, tmp_path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    run = server.runtime_dir
    log = open(tmp_path / "frontend2.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "frontend", "--model", MODEL, "--port", str(port),
         "--grpc-port", str(free_port()), "--scheduler-address", f"ipc://{run}/scheduler",
         "--scheduler-control-address", f"unix:{run}/control", "--tokenizer-address", f"ipc://{run}/tokenizer"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def test_a_killed_frontend_frees_its_blocks_and_the_other_serves_on(server, tmp_path):
    all_blocks_free(server)
    proc, second_url = start_second_frontend(server, tmp_path)
    try:
        wait_healthy(second_url, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            doomed = [pool.submit(stream_completion, second_url, greedy(p, 300)) for p in PROMPTS[:4]]
            deadline = time.monotonic() + 60
            while scheduler_stats(control(server)).num_running < 4:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            survivors = [pool.submit(stream_completion, server.base_url, greedy(p, 16)) for p in PROMPTS[4:]]
            os.kill(proc.pid, signal.SIGKILL)
            assert all(f.result().ok for f in survivors)
            assert not any(f.result().ok for f in doomed)
        all_blocks_free(server, timeout=5.0)
        assert "disconnected: aborting its 4 requests" in server.log()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_200_concurrent_streams_complete_and_free_every_block(server):
    all_blocks_free(server)
    bodies = [greedy(f"{PROMPTS[i % len(PROMPTS)]} #{i}", 4) for i in range(200)]
    results = many_streams(server.base_url, bodies)
    failures = [r for r in results if not r.ok]
    assert not failures, failures[:5]
    assert all(r.finish_reason == "length" for r in results)
    all_blocks_free(server, timeout=5.0)


def test_scheduler_killed_in_flight_requests_fail_fast_then_service_resumes(server):
    all_blocks_free(server)
    scheduler_pid = server.component_pids()["scheduler"][0]
    started = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_completion, server.base_url, greedy(p, 400),
                               on_chunk=lambda r: started.release()) for p in PROMPTS[:4]]
        for _ in range(8):
            assert started.acquire(timeout=120)
        os.kill(scheduler_pid, signal.SIGKILL)
        results = [f.result() for f in futures]  # failed, not left hanging (the client waits up to 300 s)
    for result in results:
        assert result.errors and result.errors[0]["type"] == "service_unavailable", result
    # Meanwhile, a new request is refused at once rather than left hanging
    # (the supervisor restarts the scheduler only after a one-second backoff).
    early = httpx.post(server.base_url + "/v1/completions", json=greedy("Hi", 4), timeout=30)
    assert early.status_code == 503, early.text

    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, server.log()[-4000:]
        time.sleep(0.3)
    reply = httpx.post(server.base_url + "/v1/completions", json=greedy("The capital of France is", 8), timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
    assert f"scheduler (pid {scheduler_pid}) was killed by SIGKILL" in server.log()
    assert server.component_pids()["scheduler"][0] != scheduler_pid
    all_blocks_free(server)
