"""Tensor parallelism through `pagedserve serve`: SmolLM2 (float32) on two worker ranks.

SmolLM2-135M has 9 query and 3 key/value heads: rank 0 holds two KV heads (six
query heads), rank 1 one (three), the MLP and the vocabulary are halved. The
openai client must get the tokens one worker produces, and a rank killed
mid-generation must cost no request: the group restarts and the scheduler
recomputes what it lost.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import threading

import openai
import pytest

from common.sampling_params import SamplingParams
from polling import wait_for
from serve_helpers import MODEL, cmdline, running_server
from tests.reliability.clients import stream_completion

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "In 1492, Columbus", "Water boils at", "My favourite food is", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Eager: every restart of the group in the fault test would otherwise compile again.
    args = ["--tensor-parallel-size", "2", "--kv-cache-memory", "256MiB", "--return-tokens-as-token-ids",
            "--disable-log-stats", "--enforce-eager"]
    with running_server(tmp_path_factory.mktemp("tp2"), args) as srv:
        yield srv


@pytest.fixture(scope="module")
def one_worker():
    from pagedserve import LLM
    return LLM(model=MODEL, dtype="float32", kv_cache_memory=256 << 20, enforce_eager=True)


def ranks(server) -> dict[int, int]:
    """rank -> pid of the server's worker processes (titled `pagedserve: worker RANK`)."""
    return {int(cmdline(pid).split()[-1]): pid for pid in server.component_pids().get("worker", [])}


def test_two_ranks_answer_as_one_worker_does(server, one_worker):
    assert sorted(ranks(server)) == [0, 1]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = one_worker.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, logprobs=0),
                                   use_tqdm=False)

    def ask(prompt: str):
        return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24,
                                         logprobs=0).choices[0]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, PROMPTS))
    want_tokens = [o.outputs[0].token_ids for o in expected]
    got_tokens = [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in got]
    pairs = [(a, b) for x, y in zip(got_tokens, want_tokens) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.99
    for choice, tokens, output in zip(got, got_tokens, expected):
        want = output.outputs[0]
        same = next((i for i, (a, b) in enumerate(zip(tokens, want.token_ids)) if a != b), len(tokens))
        assert choice.logprobs.token_logprobs[:same] == pytest.approx(
            [entry.logprob for entry in want.logprobs[:same]], abs=1e-3)  # up to any divergence


def test_a_killed_rank_costs_no_request(server):
    bodies = [{"model": MODEL, "prompt": f"{PROMPTS[i % 8]}{' and' * (i // 8)}", "max_tokens": 16,
               "temperature": 0, "ignore_eos": True} for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        expected = list(pool.map(lambda b: stream_completion(server.base_url, b), bodies))
    assert all(r.ok for r in expected), expected

    before = ranks(server)
    chunks_seen = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_completion, server.base_url, b, on_chunk=lambda r: chunks_seen.release())
                   for b in bodies]
        for _ in range(16 * 4):  # mid-generation
            assert chunks_seen.acquire(timeout=120)
        os.kill(before[1], signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [r.errors for r in results] == [[]] * 16
    assert [r.text for r in results] == [r.text for r in expected]
    log = server.log()
    assert "the worker group broke" in log  # rank 0 noticed and left, so the group restarts whole
    assert "registered and replaces the lost worker" in log
    after = wait_for(lambda: len(r := ranks(server)) == 2 and r, "both ranks running again", timeout=60)
    assert after[0] != before[0] and after[1] != before[1]
