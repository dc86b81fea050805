"""--api-key: every /v1 route and every gRPC call needs `Bearer <key>`; probes stay open."""
from __future__ import annotations

import grpc
import httpx
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from tests.reliability.conftest import API_KEY
from tests.reliability.stack import MODEL_NAME

COMPLETION = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WRONG_KEYS = [None, "", "Bearer", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", API_KEY, f"Basic {API_KEY}"]


def call(stack, method: str, path: str, authorization: str | None, body: dict | None = None) -> httpx.Response:
    headers = {} if authorization is None else {"Authorization": authorization}
    return httpx.request(method, stack.base_url + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("authorization", WRONG_KEYS)
@pytest.mark.parametrize("method, path, body", [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL_NAME}", None),
                                                ("POST", "/v1/completions", COMPLETION),
                                                ("POST", "/v1/chat/completions", CHAT),
                                                ("POST", "/tokenize", {"prompt": "hi"}),
                                                ("POST", "/detokenize", {"tokens": [1]}),
                                                ("GET", "/v1/no-such-route", None)])
def test_http_without_the_right_key_is_401(fast_stack, authorization, method, path, body):
    response = call(fast_stack, method, path, authorization, body)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"


def test_http_with_the_key_succeeds(fast_stack):
    key = f"Bearer {API_KEY}"
    assert call(fast_stack, "GET", "/v1/models", key).json()["data"][0]["id"] == MODEL_NAME
    completion = call(fast_stack, "POST", "/v1/completions", key, COMPLETION)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
    chat = call(fast_stack, "POST", "/v1/chat/completions", f"bearer  {API_KEY}", CHAT)  # scheme is case-insensitive
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    tokens = call(fast_stack, "POST", "/tokenize", key, {"prompt": "Hello there"}).json()["tokens"]
    assert call(fast_stack, "POST", "/detokenize", key, {"tokens": tokens}).json() == {"prompt": "Hello there"}


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_probes_stay_open(fast_stack, path):
    assert call(fast_stack, "GET", path, None).status_code == 200


def grpc_calls(stub: pb_grpc.PagedServeStub):
    return {
        "Generate": lambda md: list(stub.Generate(pb.GenerateRequest(
            text="one two", sampling_params=pb.SamplingParams(max_tokens=3)), metadata=md, timeout=30)),
        "Tokenize": lambda md: stub.Tokenize(pb.TokenizeRequest(text="one two"), metadata=md, timeout=30),
        "Detokenize": lambda md: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 2]), metadata=md, timeout=30),
        "ListModels": lambda md: stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=30),
        "Health": lambda md: stub.Health(pb.HealthRequest(), metadata=md, timeout=30),
    }


@pytest.mark.parametrize("authorization", [None, f"Bearer {API_KEY}x", API_KEY])
@pytest.mark.parametrize("method", ["Generate", "Tokenize", "Detokenize", "ListModels"])
def test_grpc_without_the_right_key_is_unauthenticated(fast_stack, authorization, method):
    with grpc.insecure_channel(fast_stack.grpc_address) as channel:
        rpc = grpc_calls(pb_grpc.PagedServeStub(channel))[method]
        with pytest.raises(grpc.RpcError) as error:
            rpc(None if authorization is None else [("authorization", authorization)])
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_health_stays_open_for_probes(fast_stack):
    with grpc.insecure_channel(fast_stack.grpc_address) as channel:
        assert grpc_calls(pb_grpc.PagedServeStub(channel))["Health"](None).ok


def test_grpc_with_the_key_succeeds(fast_stack):
    metadata = [("authorization", f"Bearer {API_KEY}")]
    with grpc.insecure_channel(fast_stack.grpc_address) as channel:
        calls = grpc_calls(pb_grpc.PagedServeStub(channel))
        chunks = calls["Generate"](metadata)
        assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert calls["Tokenize"](metadata).count > 0
        assert calls["Detokenize"](metadata).text
        assert calls["ListModels"](metadata).models[0].id == MODEL_NAME
        assert calls["Health"](metadata).ok


def test_serve_hands_the_key_to_the_frontend_through_its_environment(tmp_path):
    from pagedserve.serve import build_parser, component_commands

    args = build_parser().parse_args(["--api-key", "s3cret", "--max-waiting-requests", "7"])
    components = {c.name: c for c in component_commands(args, str(tmp_path))}
    assert components["frontend"].env == {"PAGEDSERVE_API_KEY": "s3cret"}
    assert not any("s3cret" in arg for c in components.values() for arg in c.argv)
    scheduler_argv = components["scheduler"].argv
    assert scheduler_argv[scheduler_argv.index("--max-waiting-requests") + 1] == "7"
