"""Acceptance 6: every invalid value of every parameter gets a 400 naming the
parameter in OpenAI's error body (INVALID_ARGUMENT over gRPC), and the
server keeps serving."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from serve_helpers import MODEL

HUGE_ID = 10**6  # beyond the 49152-token vocabulary
CHAT = [{"role": "user", "content": "Hi"}]

# (parameter, invalid value, other fields the case needs)
SHARED_CASES = [
    ("n", 0, {}), ("n", -1, {}), ("n", 1000, {}), ("n", "two", {}),
    ("best_of", 0, {}), ("best_of", 1, {"n": 2}), ("best_of", 3, {"stream": True}),
    ("temperature", -0.5, {}), ("temperature", 1000, {}), ("temperature", "hot", {}),
    ("top_p", 0, {}), ("top_p", 1.5, {}), ("top_k", -5, {}), ("top_k", 2.5, {}),
    ("min_p", -0.1, {}), ("min_p", 1.5, {}),
    ("presence_penalty", 2.5, {}), ("presence_penalty", -3, {}), ("frequency_penalty", 3, {}),
    ("frequency_penalty", "x", {}), ("repetition_penalty", 0, {}), ("repetition_penalty", -1, {}),
    ("logit_bias", {"abc": 1}, {}), ("logit_bias", {"5": 101}, {}), ("logit_bias", {str(HUGE_ID): 1}, {}),
    ("logit_bias", {"-1": 1}, {}), ("logit_bias", [1, 2], {}), ("logit_bias", {"5": "x"}, {}),
    ("seed", "x", {}), ("seed", 2**64, {}), ("seed", 1.5, {}),
    ("stop", 5, {}), ("stop", [1], {}),
    ("stop_token_ids", [-1], {}), ("stop_token_ids", [HUGE_ID], {}), ("stop_token_ids", "x", {}),
    ("include_stop_str_in_output", "maybe", {}), ("ignore_eos", "maybe", {}),
    ("min_tokens", -1, {}), ("min_tokens", 50, {"max_tokens": 10}), ("min_tokens", "x", {}),
    ("max_tokens", 0, {}), ("max_tokens", -3, {}), ("max_tokens", "many", {}), ("max_tokens", 10**6, {}),
    ("prompt_logprobs", -1, {}), ("prompt_logprobs", 21, {}), ("prompt_logprobs", "x", {}),
    ("echo", "maybe", {}), ("skip_special_tokens", "maybe", {}), ("spaces_between_special_tokens", "maybe", {}),
    ("priority", "high", {}), ("priority", 1.5, {}), ("user", 5, {}), ("user", ["a"], {}),
    ("stream", "maybe", {}), ("stream_options", {"include_usage": True}, {}), ("stream_options", "x", {}),
    ("model", "gpt-4", {}), ("cache_salt", 5, {}),
]
COMPLETION_CASES = [
    ("logprobs", -1, {}), ("logprobs", 21, {}), ("logprobs", "x", {}),
    ("prompt", [], {}), ("prompt", [[]], {}), ("prompt", [HUGE_ID], {}), ("prompt", 5, {}), ("prompt", None, {}),
    ("suffix", "x", {}), ("add_special_tokens", "maybe", {}),
]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
AUDIO = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                      {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
CHAT_CASES = [
    ("logprobs", "maybe", {}), ("top_logprobs", 5, {}), ("top_logprobs", 21, {"logprobs": True}),
    ("top_logprobs", -1, {"logprobs": True}), ("max_completion_tokens", 0, {}), ("max_completion_tokens", 10**6, {}),
    ("messages", [], {}), ("messages", "Hi", {}), ("messages", [{"content": "no role"}], {}),
    ("messages", IMAGE, {}), ("messages", AUDIO, {}),
    ("add_generation_prompt", "maybe", {}), ("continue_final_message", True, {}),
    ("continue_final_message", "maybe", {}), ("chat_template_kwargs", {"tokenize": True}, {}),
    ("chat_template_kwargs", "x", {}), ("tools", [{"type": "function", "function": {"name": "f"}}], {}),
    ("response_format", {"type": "xml"}, {}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}, {}),
]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1{path}", json=body, timeout=60)


def assert_names(response: httpx.Response, param: str) -> None:
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param + "."), (param, error)


def case_id(case) -> str:
    return f"{case[0]}={case[1]!r}"[:40]


@pytest.mark.parametrize("case", SHARED_CASES + COMPLETION_CASES, ids=case_id)
def test_invalid_completion_parameters_are_400s_naming_them(server, case):
    param, value, extra = case
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra, param: value}
    assert_names(post(server, "/completions", body), param)


@pytest.mark.parametrize("case", SHARED_CASES + CHAT_CASES, ids=case_id)
def test_invalid_chat_parameters_are_400s_naming_them(server, case):
    param, value, extra = case
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra, param: value}
    response = post(server, "/chat/completions", body)
    if param == "messages" and value == IMAGE:  # image parts reach the tokenizer pool: a text-only model
        assert_names(response, "messages")
        assert "takes no images" in response.json()["error"]["message"]
    elif param == "messages" and value == AUDIO:
        assert_names(response, "messages.0.content")
        assert value[0]["content"][-1]["type"] in response.json()["error"]["message"]
    else:
        assert_names(response, param)


# gRPC: proto types rule out wrong types, so the cases are values.
GRPC_CASES = [
    ("n", {"n": 0}), ("n", {"n": -1}), ("best_of", {"n": 3, "best_of": 2}), ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}), ("top_k", {"top_k": -5}), ("min_p", {"min_p": 2}),
    ("presence_penalty", {"presence_penalty": 3}), ("frequency_penalty", {"frequency_penalty": -3}),
    ("repetition_penalty", {"repetition_penalty": 0}), ("logit_bias", {"logit_bias": {HUGE_ID: 1.0}}),
    ("logit_bias", {"logit_bias": {5: 200.0}}), ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("max_tokens", {"max_tokens": 0}), ("max_tokens", {"max_tokens": 10**6}),
    ("min_tokens", {"min_tokens": 50, "max_tokens": 10}), ("stop_token_ids", {"stop_token_ids": [HUGE_ID]}),
    ("logprobs", {"logprobs": -1}), ("logprobs", {"logprobs": 21}), ("prompt_logprobs", {"prompt_logprobs": 21}),
]


@pytest.mark.parametrize("param, fields", GRPC_CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(GRPC_CASES)])
def test_invalid_grpc_parameters_are_invalid_argument_naming_them(stub, param, fields):
    request = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(**fields))
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert param in error.value.details()


def test_grpc_bad_prompts_and_chats(stub):
    for request, name in [(pb.GenerateRequest(), "prompt"), (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[HUGE_ID])),
                                                              "out of vocabulary"),
                          (pb.GenerateRequest(chat=pb.ChatMessages()), "chat"),
                          (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")],
                                                                   continue_final_message=True)), "continue_final")]:
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, timeout=60))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in error.value.details()


def test_the_server_keeps_serving_after_the_bad_requests(server, client, stub):
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0).choices[0].text
    responses = list(stub.Generate(pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=2)),
                                   timeout=60))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert set(server.component_pids()) >= {"frontend", "scheduler", "worker", "tokenizer"}
    with pytest.raises(openai.BadRequestError) as error:  # and the openai client sees the 400s as such
        client.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={"x": 1})
    assert error.value.body["param"] == "logit_bias"
