"""A frontend started on a model whose generation_config.json recommends
sampling values uses them for fields a request leaves unset (HTTP and gRPC),
as vLLM's --generation-config auto; `vllm` ignores them."""
from __future__ import annotations

import json
import shutil

import grpc
import httpx

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from tests.frontend.conftest import start_frontend

RECOMMENDED = {"temperature": 0.3, "top_p": 0.8, "top_k": 50, "repetition_penalty": 1.1}


def frontend_on_model_with_generation_config(server, tmp_path, *extra: str):
    args = list(server.frontend_args)
    model_dir = tmp_path / "model"
    shutil.copytree(args[args.index("--model") + 1], model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    args[args.index("--model") + 1] = str(model_dir)
    return start_frontend([*args, *extra], tmp_path / "frontend.log")


def received(server, request_id: str):
    server.scheduler.wait_for(lambda r: any(request_id in q.request_id for q in r.requests))
    return next(q for q in server.scheduler.snapshot().requests if request_id in q.request_id)


def completion(base_url: str, request_id: str, **fields) -> None:
    response = httpx.post(f"{base_url}/v1/completions", headers={"X-Request-Id": request_id}, timeout=30,
                          json={"model": "tiny-model", "prompt": "Hi", "max_tokens": 2, **fields})
    assert response.status_code == 200, response.text


def test_unset_fields_take_the_models_values(server, tmp_path):
    frontend, base_url, grpc_address = frontend_on_model_with_generation_config(server, tmp_path)
    try:
        completion(base_url, "gen-defaults-unset")
        params = received(server, "gen-defaults-unset").sampling_params
        # top_k 50 is transformers' own default: not a recommendation (as vLLM).
        assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.3, 0.8, 0, 1.1)
        completion(base_url, "gen-defaults-set", temperature=0.9, repetition_penalty=1.0)
        params = received(server, "gen-defaults-set").sampling_params
        assert (params.temperature, params.top_p, params.repetition_penalty) == (0.9, 0.8, 1.0)
        with grpc.insecure_channel(grpc_address) as channel:
            stub = pb_grpc.PagedServeStub(channel)
            list(stub.Generate(pb.GenerateRequest(request_id="gen-defaults-grpc", text="Hi",
                                                  sampling_params=pb.SamplingParams(max_tokens=2))))
        params = received(server, "gen-defaults-grpc").sampling_params
        assert (params.temperature, params.top_p, params.repetition_penalty) == (0.3, 0.8, 1.1)
    finally:
        frontend.stop()


def test_vllm_ignores_the_file(server, tmp_path):
    frontend, base_url, _ = frontend_on_model_with_generation_config(server, tmp_path, "--generation-config", "vllm")
    try:
        completion(base_url, "gen-defaults-vllm")
        params = received(server, "gen-defaults-vllm").sampling_params
        assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 1.0)
    finally:
        frontend.stop()
