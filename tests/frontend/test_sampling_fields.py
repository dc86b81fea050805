"""Every sampling field of both HTTP APIs and of gRPC reaches the scheduler as
the SamplingParams the engine runs (fake scheduler, real frontend process)."""
from __future__ import annotations

import re

import httpx
import openai

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc
from common.sampling_params import SamplingParams

import grpc


def sent(server, request_id: str):
    return next(r for r in reversed(server.scheduler.snapshot().requests) if r.request_id == request_id)


def sent_over_http(server, response_id: str, prompt_index: int | None = None):
    """The request the scheduler got for a response whose id came from X-Request-Id:
    the scheduler's id is that with a random suffix (then the prompt's index)."""
    pattern = re.escape(response_id) + "-[0-9a-f]{8}" + ("" if prompt_index is None else f"-{prompt_index}")
    return next(r for r in reversed(server.scheduler.snapshot().requests) if re.fullmatch(pattern, r.request_id))


def post(server, path: str, body: dict, request_id: str) -> httpx.Response:
    return httpx.post(server.api_url + path, json=body, headers={"X-Request-Id": request_id}, timeout=30)


FIELDS = {"n": 2, "best_of": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "seed": 42,
          "presence_penalty": 0.3, "frequency_penalty": -0.4, "repetition_penalty": 1.2,
          "logit_bias": {"5": 2.5, "9": -100}, "stop": ["x", "yz"], "stop_token_ids": [3],
          "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 2, "max_tokens": 9,
          "prompt_logprobs": 2, "skip_special_tokens": False, "spaces_between_special_tokens": False,
          "priority": -3, "user": "u1"}
EXPECTED = SamplingParams(n=2, best_of=3, temperature=0.5, top_p=0.9, top_k=7, min_p=0.05, seed=42,
                          presence_penalty=0.3, frequency_penalty=-0.4, repetition_penalty=1.2,
                          logit_bias={5: 2.5, 9: -100.0}, stop=["x", "yz"], stop_token_ids=[3],
                          include_stop_str_in_output=True, ignore_eos=True, min_tokens=2, max_tokens=9,
                          prompt_logprobs=2, skip_special_tokens=False, spaces_between_special_tokens=False)


def test_completion_fields(server):
    response = post(server, "/completions", {"prompt": "Hi", "logprobs": 4, **FIELDS}, "fields-1")
    assert response.status_code == 200, response.text
    request = sent_over_http(server, "cmpl-fields-1", 0)
    assert request.priority == -3
    assert request.sampling_params == SamplingParams(**{**_fields(EXPECTED), "logprobs": 4})


def test_chat_fields(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 3, **FIELDS,
            "max_tokens": None, "max_completion_tokens": 9}
    assert post(server, "/chat/completions", body, "fields-2").status_code == 200
    assert sent_over_http(server, "chatcmpl-fields-2").sampling_params == SamplingParams(**{**_fields(EXPECTED), "logprobs": 3})
    body = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    assert post(server, "/chat/completions", body, "fields-3").status_code == 200
    params = sent_over_http(server, "chatcmpl-fields-3").sampling_params
    assert params.logprobs == 0 and params.max_tokens is None  # as many as fit


def test_defaults_and_echo_with_logprobs(server):
    # Completions default to 16 tokens, as OpenAI and vLLM do; an explicit null means as many as fit.
    assert post(server, "/completions", {"prompt": "Hi"}, "fields-4").status_code == 200
    assert sent_over_http(server, "cmpl-fields-4", 0).sampling_params == SamplingParams(max_tokens=16)
    assert post(server, "/completions", {"prompt": "Hi", "max_tokens": None}, "fields-4b").status_code == 200
    assert sent_over_http(server, "cmpl-fields-4b", 0).sampling_params == SamplingParams(max_tokens=None)
    body = {"prompt": "Hello, world", "echo": True, "logprobs": 2, "max_tokens": 3}
    response = post(server, "/completions", body, "fields-5")
    assert response.status_code == 200
    params = sent_over_http(server, "cmpl-fields-5", 0).sampling_params
    assert params.logprobs == 2 and params.prompt_logprobs == 2  # the echoed prompt's logprobs
    prompt = server.tokenizer.encode("Hello, world")
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [server.tokenizer.decode([t]) for t in prompt + server.scheduler.script[:3]]
    assert logprobs["token_logprobs"] == [None] + [-1.0] * (len(prompt) - 1) + [-0.5] * 3
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][-1] == {logprobs["tokens"][-1]: -0.5}
    assert "prompt_logprobs" not in response.json()["choices"][0] or \
        response.json()["choices"][0]["prompt_logprobs"] is None  # not asked for itself


def test_grpc_fields(server):
    proto = pb.SamplingParams(
        n=2, best_of=3, temperature=0.5, top_p=0.875, top_k=7, min_p=0.0625, seed=42, presence_penalty=0.25,
        frequency_penalty=-0.5, repetition_penalty=1.25, logit_bias={5: 2.5, 9: -100}, stop=["x", "yz"],
        stop_token_ids=[3], include_stop_str_in_output=True, ignore_eos=True, min_tokens=2, max_tokens=9,
        logprobs=4, prompt_logprobs=2, skip_special_tokens=False, spaces_between_special_tokens=False)
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pagedserve_pb2_grpc.PagedServeStub(channel)
        list(stub.Generate(pb.GenerateRequest(request_id="grpc-fields", text="Hi", sampling_params=proto,
                                              priority=-3), timeout=30))
    request = sent(server, "grpc-fields")
    # Values exact in float32, so they compare equal after the proto's float fields.
    assert request.priority == -3
    assert request.sampling_params == SamplingParams(**{
        **_fields(EXPECTED), "top_p": 0.875, "min_p": 0.0625, "presence_penalty": 0.25, "frequency_penalty": -0.5,
        "repetition_penalty": 1.25, "logprobs": 4})


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def test_null_means_the_default(server):
    """OpenAI's schema makes these fields nullable, and clients send null for
    "not set" (e.g. the openai client given n=None, stream=None)."""
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0,
                           default_headers={"X-Request-Id": "nulls-1"})
    reply = client.chat.completions.create(model="tiny-model", messages=[{"role": "user", "content": "Hi"}],
                                           max_completion_tokens=3, n=None, stream=None, logprobs=None,
                                           stream_options=None, extra_body={"echo": None, "min_tokens": None,
                                                                            "ignore_eos": None, "priority": None})
    assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    assert sent_over_http(server, "chatcmpl-nulls-1").sampling_params == SamplingParams(max_tokens=3)
    body = {"prompt": "Hi", "max_tokens": 3, "n": None, "stream": None, "echo": None, "add_special_tokens": None,
            "include_stop_str_in_output": None, "skip_special_tokens": None}
    assert post(server, "/completions", body, "nulls-2").status_code == 200
    assert sent_over_http(server, "cmpl-nulls-2", 0).sampling_params == SamplingParams(max_tokens=3)
    # max_tokens itself stays nullable: null asks for as many as fit.
    assert post(server, "/completions", {**body, "max_tokens": None}, "nulls-3").status_code == 200
    assert sent_over_http(server, "cmpl-nulls-3", 0).sampling_params.max_tokens is None
