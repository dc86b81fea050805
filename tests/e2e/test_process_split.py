"""The real process split: `pagedserve serve` starts a frontend, a tokenizer pool
(router + 2 processes), a scheduler and a worker, talking over real sockets.
Clients are the official `openai` client, raw HTTP and the generated gRPC stub."""
from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time
import urllib.request

import grpc
import openai
import pytest
import zmq

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from common.sampling_params import SamplingParams
from serve_helpers import MODEL, Server, cmdline, descendants, metric_samples

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


def test_metrics_parse_and_count_requests(server, client):
    before = metric_samples(server)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=4)
    after = metric_samples(server)
    assert after["pagedserve:request_success_total"] - before.get("pagedserve:request_success_total", 0) == 3
    assert after["pagedserve:generation_tokens_total"] >= before.get("pagedserve:generation_tokens_total", 0) + 12
    assert after["pagedserve:e2e_request_latency_seconds_count"] >= 3
    for name in ("pagedserve:num_requests_running", "pagedserve:kv_cache_usage_perc",
                 "pagedserve:prefix_cache_queries_total", "pagedserve:num_preemptions_total",
                 "pagedserve:time_to_first_token_seconds_count"):
        assert name in after


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
        time.sleep(0.3)
        sock.close()
    time.sleep(1)
    assert "dropped a bad frame" in server.log()
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in chat.choices[0].message.content
    assert set(server.component_pids()) >= {"frontend", "scheduler", "worker", "tokenizer"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_serve_leaves_no_process(tmp_path, sig):
    """... and a request in flight when it is told to stop still finishes: the API
    stops first, and the rest only once it has let its requests end."""
    srv = Server(tmp_path, ["--disable-log-stats", "--tokenizer-pool-size", "2"])
    try:
        srv.wait_ready()
        pids = descendants(srv.proc.pid)
        assert len(pids) >= 6
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        srv.proc.send_signal(sig)
        chunks += list(stream)
        assert sum(len(c.choices[0].text) > 0 for c in chunks) > 1
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        code = srv.stop(sig)
    assert code == 0
    time.sleep(0.5)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "pagedserve" in cmdline(p)]
    assert not alive, [cmdline(p) for p in alive]
