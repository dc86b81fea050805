"""The real process split: `pagedserve serve` starts a frontend, a tokenizer pool
(router + 2 processes), a scheduler and a worker, talking over real sockets.
Clients are the official `openai` client, raw HTTP and the generated gRPC stub."""
from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import urllib.request

import grpc
import openai
import pytest
import zmq

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from common.sampling_params import SamplingParams
from polling import wait_for
from serve_helpers import MODEL, Server, cmdline, descendants

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "In 1492, Columbus", "Water boils at", "My favourite food is", "The quick brown fox"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_every_component_is_its_own_process(server):
    pids = server.component_pids()
    assert len(pids.get("frontend", [])) == 1
    assert len(pids.get("scheduler", [])) == 1
    assert len(pids.get("worker", [])) == 1
    tokenizer_workers = [p for p in pids.get("tokenizer", []) if cmdline(p) != "pagedserve: tokenizer"]
    assert len(tokenizer_workers) >= 2, pids
    # ps names serve too, as ops find it (pgrep -f "pagedserve: serve").
    assert cmdline(server.proc.pid) == "pagedserve: serve"


def test_chat_and_completion_answer_paris(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                           max_tokens=8)
    assert "Paris" in completion.choices[0].text
    assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"


def test_curl_style_raw_http_chat(server):
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of France?"}], ' \
           b'"temperature": 0, "max_tokens": 32}' % MODEL.encode()
    request = urllib.request.Request(server.base_url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        assert b"Paris" in response.read()


def test_streamed_deltas_join_to_the_non_streamed_text(client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(deltas) == full and len(deltas) > 2
    kwargs = dict(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=24)
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full


def test_32_concurrent_requests_match_the_offline_engine(client, offline_llm):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].text for o in offline_llm.generate(prompts, params, use_tqdm=False)]

    def ask(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, prompts))
    assert got == expected


def test_grpc_generate_yields_the_same_tokens(server, client, offline_llm):
    stub = pb_grpc.PagedServeStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    request = pb.GenerateRequest(text="The capital of France is",
                                 sampling_params=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    chunks = list(stub.Generate(request, timeout=120))
    token_ids = [t for c in chunks for t in c.token_ids]
    expected = offline_llm.generate(["The capital of France is"],
                                    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert token_ids == expected.outputs[0].token_ids
    assert "".join(c.text for c in chunks) == expected.outputs[0].text
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].usage.completion_tokens == 12
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(temperature=-1)),
                           timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.value.details()


def labelled_samples(server) -> dict[tuple[str, tuple], float]:
    """The server's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_count_exactly_what_the_api_returned(server, client):
    """Scraped from the real stack before and after real requests: the token
    counters move by the usage the API reported, each finished request is
    counted once under its finish reason, and each latency histogram gets one
    observation per request (inter-token: one per token after the first)."""
    before = labelled_samples(server)
    replies = [client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4 + i)
               for i, prompt in enumerate(PROMPTS[:2])]
    replies.append(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=64))
    after = labelled_samples(server)
    assert [r.choices[0].finish_reason for r in replies] == ["length", "length", "stop"]

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return after[key] - before.get(key, 0.0)

    assert moved("pagedserve:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    assert moved("pagedserve:generation_tokens_total") == sum(r.usage.completion_tokens for r in replies)
    assert moved("pagedserve:request_success_total", finished_reason="length") == 2
    assert moved("pagedserve:request_success_total", finished_reason="stop") == 1
    assert moved("pagedserve:request_success_total", finished_reason="abort") == 0
    assert moved("pagedserve:time_to_first_token_seconds_count") == 3
    assert moved("pagedserve:e2e_request_latency_seconds_count") == 3
    assert moved("pagedserve:inter_token_latency_seconds_count") == sum(r.usage.completion_tokens - 1
                                                                          for r in replies)
    assert after[("pagedserve:num_requests_running", (("model_name", MODEL),))] == 0
    assert after[("pagedserve:kv_cache_usage_perc", (("model_name", MODEL),))] == 0
    for name in ("pagedserve:prefix_cache_queries_total", "pagedserve:num_preemptions_total"):
        assert (name, (("model_name", MODEL),)) in after


def test_garbage_on_every_internal_socket_is_dropped(server, client):
    ctx = zmq.Context.instance()
    rng = random.Random(0)
    garbage = [[b"garbage"], [bytes([1]), b"\xc1\xff\x00"], [bytes([22]), b"not msgpack"],
               [bytes([1]), b"\x81\xa1x\x01"], [bytes(rng.randrange(256) for _ in range(64))]]
    for name in ("scheduler", "worker", "tokenizer", "tokenizer-backend"):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"ipc://{server.runtime_dir}/{name}")
        for frames in garbage:
            sock.send_multipart(frames)
        sock.close()  # the linger delivers what is queued
    wait_for(lambda: "dropped a bad frame" in server.log(), "a component to drop a bad frame")
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in chat.choices[0].message.content
    assert set(server.component_pids()) >= {"frontend", "scheduler", "worker", "tokenizer"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_stopping_serve_leaves_no_process(tmp_path, sig):
    """... and a request in flight when it is told to stop still finishes: the API
    stops first, and the rest only once it has let its requests end."""
    srv = Server(tmp_path, ["--disable-log-stats", "--tokenizer-pool-size", "2"])
    try:
        srv.wait_ready()
        pids = descendants(srv.proc.pid)
        assert len(pids) >= 6
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        # Few tokens: they must all come within the frontend's drain time (DRAIN_S), however loaded the machine.
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        srv.proc.send_signal(sig)
        chunks += list(stream)
        assert sum(len(c.choices[0].text) > 0 for c in chunks) > 1
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        code = srv.stop(sig)
    assert code == 0

    def still_alive() -> list[int]:
        return [p for p in pids if os.path.exists(f"/proc/{p}") and "pagedserve" in cmdline(p)]
    try:
        wait_for(lambda: not still_alive(), "every process of serve to exit", timeout=30)
    except AssertionError:
        raise AssertionError([cmdline(p) for p in still_alive()]) from None
