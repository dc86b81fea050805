"""Issue 50 acceptance over HTTP and gRPC: `pagedserve serve --enable-lora --lora-modules` on a
tiny Llama; one adapter given at start, others loaded at run time; 8 concurrent requests mixing
both adapters and the base model each get transformers + peft's greedy tokens, while requests
on an adapter that does not fit the model fail with 400 and the worker keeps serving; gRPC gives
the same tokens; unloading and reloading a name (another path, or changed files at the same
path) never reuses the old weights or KV; unknown names and bad paths are OpenAI errors."""
from __future__ import annotations

import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import torch
from safetensors.torch import load_file, save_file

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc
from peft_adapters import ALL_LINEAR, build_peft_adapter, peft_reference
from serve_helpers import metric_samples, running_server
from tiny_models import build_tiny_llama_with_smollm2_tokenizer, hf_greedy

NEW_TOKENS = 10


def misshapen_copy(source, target) -> None:
    """A copy of the adapter at `source` whose q_proj lora_A has 8 more input features than the
    model: names and ranks pass the frontend's checks, only the worker sees the mismatch."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.cat([tensors[key], torch.zeros(tensors[key].shape[0], 8)], dim=1)
    save_file(tensors, str(target / "adapter_model.safetensors"))


def test_mixed_adapters_over_http_match_peft(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    build_tiny_llama_with_smollm2_tokenizer(base)
    build_peft_adapter(base, tmp_path / "attn", rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    build_peft_adapter(base, tmp_path / "full", rank=4, targets=ALL_LINEAR, seed=2)
    misshapen_copy(tmp_path / "attn", tmp_path / "misshapen")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 9, 13, 7, 5, 17, 9, 6)]
    models = [str(base), "attn", "full", "attn", "full", str(base), "full", "attn"]
    env = {**os.environ, "PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    (tmp_path / "srv").mkdir()
    with running_server(tmp_path / "srv", ["--model", str(base), "--enforce-eager", "--disable-log-stats",
                                           "--kv-cache-memory", "128MiB", "--block-size", "4", "--enable-lora", "--max-loras", "3",
                                           "--max-cpu-loras", "3", "--max-lora-rank", "8",
                                           "--lora-modules", f"attn={tmp_path / 'attn'}"], env=env) as server:
        http = httpx.Client(base_url=server.base_url, timeout=120)
        for name in ("full", "misshapen"):
            loaded = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path / name)})
            assert loaded.status_code == 200, loaded.text
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert cards["attn"]["parent"] == cards["full"]["parent"] == str(base)
        worker_pids = server.component_pids()["worker"]

        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int, model: str | None = None, prompt: list[int] | None = None) -> list[int]:
            reply = client.completions.create(model=model or models[i], prompt=prompt or prompts[i], temperature=0,
                                              max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True,
                                                                                 "return_token_ids": True})
            return reply.choices[0].model_extra["token_ids"]

        def ask_misshapen(stream: bool) -> Exception | None:
            try:
                reply = client.completions.create(model="misshapen", prompt=prompts[0], max_tokens=NEW_TOKENS,
                                                  stream=stream)
                if stream:
                    list(reply)
            except openai.APIError as e:
                return e
            return None

        # The misshapen adapter's requests arrive with the others: they fail, the others run.
        with ThreadPoolExecutor(10) as pool:
            failures = [pool.submit(ask_misshapen, stream) for stream in (False, True)]
            got = list(pool.map(ask, range(8)))
            failures = [f.result() for f in failures]
        assert isinstance(failures[0], openai.BadRequestError), failures[0]
        assert failures[0].body["type"] == "invalid_request_error" and "lora_A" in failures[0].body["message"]
        assert isinstance(failures[1], openai.APIError) and "lora_A" in str(failures[1]), failures[1]
        assert server.component_pids()["worker"] == worker_pids, "the worker restarted"

        # gRPC: the same greedy tokens as HTTP, for an adapter and the base model.
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pagedserve_pb2_grpc.PagedServeStub(channel)

            def generate(i: int, model: str) -> list[int]:
                params = pb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
                return [t for reply in stub.Generate(pb.GenerateRequest(
                    model=model, token_ids=pb.TokenIds(ids=prompts[i]), sampling_params=params), timeout=120)
                    for t in reply.token_ids]

            for i in (1, 2, 5):
                assert generate(i, models[i]) == got[i], models[i]
            for model, code in (("nope", grpc.StatusCode.NOT_FOUND), ("misshapen", grpc.StatusCode.INVALID_ARGUMENT)):
                try:
                    generate(0, model)
                    raise AssertionError(f"{model}: no error")
                except grpc.RpcError as e:
                    assert e.code() == code and model in e.details(), e

        with openai_error(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=1)
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "full"}).status_code == 200
        with openai_error(openai.NotFoundError):
            client.completions.create(model="full", prompt="x", max_tokens=1)

        # A name reloaded from another path, then from its old path after the files changed there:
        # each time the new files' tokens (no old weights in the worker, no old KV in the cache).
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "full", "lora_path": str(tmp_path / "attn")}
                         ).status_code == 200
        reloaded_elsewhere = ask(2, model="full")
        shutil.copytree(tmp_path / "full", tmp_path / "moving")
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "moving", "lora_path": str(tmp_path / "moving")}
                         ).status_code == 200
        assert ask(2, model="moving") == got[2]  # also fills the prefix cache under "moving"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "moving"}).status_code == 200
        shutil.rmtree(tmp_path / "moving")
        shutil.copytree(tmp_path / "attn", tmp_path / "moving")
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "moving", "lora_path": str(tmp_path / "moving")}
                         ).status_code == 200
        reloaded_in_place = ask(2, model="moving")

        # Every request is done: no KV block is left held (the failed ones' included).
        deadline = time.monotonic() + 30
        while metric_samples(server)["pagedserve:kv_cache_usage_perc"] != 0:
            assert time.monotonic() < deadline, "KV blocks still held after every request ended"
            time.sleep(0.2)

    for name in (str(base), "attn", "full"):
        reference = peft_reference(base, None if name == str(base) else tmp_path / name)
        for prompt, tokens, model in zip(prompts, got, models):
            if model == name:
                assert tokens == hf_greedy(reference, prompt, NEW_TOKENS), (name, prompt)
        if name == "attn":
            assert reloaded_elsewhere == reloaded_in_place == hf_greedy(reference, prompts[2], NEW_TOKENS)
    assert reloaded_elsewhere != got[2], "the two adapters agree on this prompt: the reload check proves nothing"


class openai_error:
    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        assert kind is not None and issubclass(kind, self.kind), f"expected {self.kind.__name__}, got {kind}"
        return True
