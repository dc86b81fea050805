"""--lora-modules on a real frontend process (fake scheduler): an adapter's name picks it as
`model`, /v1/models lists it with its parent, unknown names are 404s, bad paths refused."""
import json
import subprocess
import sys

import openai
import pytest

from tests.frontend.conftest import start_frontend
from tests.frontend.fakes import FakeScheduler  # noqa: F401 (the server fixture's scheduler)


def write_adapter(directory, rank: int, targets=("q_proj", "v_proj"), weights=None) -> None:
    """A PEFT adapter directory: its config and safetensors with lora_A/lora_B of `rank` for each
    target of layer 0 (the frontend checks names and ranks; the fake engine never reads them)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16,
                                                              "target_modules": list(targets)}))
    prefix = "base_model.model.model.layers.0.self_attn"
    save_file(weights if weights is not None else {
        f"{prefix}.{t}.lora_{ab}.weight": torch.zeros((rank, 32) if ab == "A" else (32, rank))
        for t in targets for ab in "AB"}, str(directory / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def lora_frontend(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-frontend")
    adapter = tmp / "sql-adapter"
    write_adapter(adapter, rank=8)
    frontend, base_url, grpc_address = start_frontend(server.frontend_args + ["--lora-modules", f"sql={adapter}"],
                                                      tmp / "frontend.log")
    try:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        client.grpc_address = grpc_address
        yield client, adapter
    finally:
        frontend.stop()


def test_models_list_adapters_with_parent(lora_frontend, server):
    client, adapter = lora_frontend
    cards = {card.id: card for card in client.models.list().data}
    base = next(name for name in cards if name != "sql")
    assert cards["sql"].parent == base and cards["sql"].root == str(adapter)
    assert getattr(cards[base], "parent", None) is None


def test_adapter_name_selects_the_adapter(lora_frontend, server):
    client, adapter = lora_frontend
    response = client.completions.create(model="sql", prompt="Say hello to me.", max_tokens=3)
    sent = next(r for r in reversed(server.scheduler.snapshot().requests) if r.request_id == response.id + "-0")
    assert sent.lora_request is not None
    assert (sent.lora_request.lora_name, sent.lora_request.lora_path) == ("sql", str(adapter))
    base = client.models.list().data[0].id
    response = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
    assert next(r for r in reversed(server.scheduler.snapshot().requests)
                if r.request_id.startswith(response.id)).lora_request is None


def test_unknown_model_is_a_404(lora_frontend):
    client, _ = lora_frontend
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)
    assert error.value.body["code"] == "model_not_found"


def test_bad_adapter_path_stops_the_frontend(server, tmp_path):
    result = subprocess.run([sys.executable, "-m", "frontend.frontend_cli", *server.frontend_args,
                             "--lora-modules", f"bad={tmp_path / 'missing'}"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "no such directory" in result.stderr and "Traceback" not in result.stderr


def test_runtime_loading_and_unloading(server, tmp_path):
    import httpx

    adapter = tmp_path / "chat-adapter"
    write_adapter(adapter, rank=4)
    unsupported = tmp_path / "embedding-adapter"
    unsupported.mkdir()
    (unsupported / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                                "target_modules": ["embed_tokens"]}))
    import os
    os.environ["PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # the frontend process inherits it
    try:
        frontend, base_url, _ = start_frontend(server.frontend_args + ["--max-lora-rank", "8"],
                                               tmp_path / "frontend.log")
    finally:
        del os.environ["PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING"]
    try:
        http = httpx.Client(base_url=base_url, timeout=30)
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "no such directory" in bad.json()["error"]["message"]
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": str(unsupported)})
        assert refused.status_code == 400 and "embed_tokens" in refused.json()["error"]["message"]
        for name, expected in bad_adapters(tmp_path).items():  # each refused before it reaches a worker
            refused = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path / name)})
            assert refused.status_code == 400, (name, refused.text)
            assert refused.json()["error"]["type"] == "invalid_request_error"
            assert expected in refused.json()["error"]["message"], (name, refused.json())
        assert not {"empty", "rank-16", "pickle", "corrupt", "truncated", "embedding", "rank-mismatch"} & {
            card["id"] for card in http.get("/v1/models").json()["data"]}
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapter)}).status_code == 200
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapter)}).status_code == 400
        assert "chat" in [card["id"] for card in http.get("/v1/models").json()["data"]]
        completion = http.post("/v1/completions", json={"model": "chat", "prompt": "Say hello", "max_tokens": 2})
        assert completion.status_code == 200
        sent = next(r for r in reversed(server.scheduler.snapshot().requests)
                    if r.request_id == completion.json()["id"] + "-0")
        assert sent.lora_request.lora_name == "chat"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        after = http.post("/v1/completions", json={"model": "chat", "prompt": "Say hello", "max_tokens": 2})
        assert after.status_code == 404
    finally:
        frontend.stop()


def test_runtime_updates_are_off_by_default(lora_frontend):
    client, adapter = lora_frontend
    response = client._client.post(str(client.base_url).rstrip("/").removesuffix("/v1") + "/v1/load_lora_adapter",
                                   json={"lora_name": "y", "lora_path": str(adapter)})
    assert response.status_code == 404


def test_grpc_model_field_selects_the_adapter(lora_frontend, server):
    import grpc

    from common.grpc_gen import pagedserve_pb2 as pb
    from common.grpc_gen import pagedserve_pb2_grpc

    client, adapter = lora_frontend
    with grpc.insecure_channel(client.grpc_address) as channel:
        stub = pagedserve_pb2_grpc.PagedServeStub(channel)
        list(stub.Generate(pb.GenerateRequest(request_id="grpc-lora", model="sql", text="Say hello",
                                              sampling_params=pb.SamplingParams(max_tokens=2)), timeout=30))
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(pb.GenerateRequest(model="nope", text="x"), timeout=30))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in error.value.details()
        models = {m.id: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models}
    base = client.models.list().data[0].id
    assert models["sql"].parent == base and models["sql"].root == str(adapter)  # as /v1/models
    assert models[base].parent == ""
    sent = next(r for r in reversed(server.scheduler.snapshot().requests) if r.request_id == "grpc-lora")
    assert sent.lora_request.lora_name == "sql"


def bad_adapters(root) -> dict[str, str]:
    """Adapters the frontend refuses (under --max-lora-rank 8), by directory name -> what its error says."""
    import torch

    (root / "empty").mkdir()
    write_adapter(root / "rank-16", rank=16)
    write_adapter(root / "pickle", rank=4)
    (root / "pickle" / "adapter_model.safetensors").rename(root / "pickle" / "adapter_model.bin")
    write_adapter(root / "corrupt", rank=4)
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    write_adapter(root / "truncated", rank=4)
    data = (root / "truncated" / "adapter_model.safetensors").read_bytes()
    (root / "truncated" / "adapter_model.safetensors").write_bytes(data[:-100])
    write_adapter(root / "embedding", rank=4, weights={
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 32)})
    write_adapter(root / "rank-mismatch", rank=4, weights={
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 32)})
    return {"empty": "no adapter_config.json", "rank-16": "exceeds max_lora_rank 8", "pickle": "adapter_model.bin", "corrupt": "not a valid safetensors",
            "truncated": "truncated", "embedding": "unsupported weight", "rank-mismatch": "not of rank r=4",
            "no-such-dir": "no such directory"}


def test_bad_lora_modules_fail_at_start(tmp_path):
    """`serve --lora-modules` checks every adapter before starting a process: a ConfigError."""
    from common.errors import ConfigError
    from pagedserve.serve import build_parser, component_commands

    bad_adapters(tmp_path)
    write_adapter(tmp_path / "good", rank=8)
    parser = build_parser()
    for name, expected in (("rank-16", "exceeds max_lora_rank 8"), ("corrupt", "not a valid safetensors"),
                           ("no-such-dir", "no such directory")):
        args = parser.parse_args(["--model", str(tmp_path), "--enable-lora", "--max-lora-rank", "8",
                                  "--lora-modules", f"good={tmp_path / 'good'}", f"{name}={tmp_path / name}"])
        with pytest.raises(ConfigError, match=f"--lora-modules {name}: .*{expected}"):
            component_commands(args, str(tmp_path))
    args = parser.parse_args(["--model", str(tmp_path), "--enable-lora", "--max-lora-rank", "8",
                              "--lora-modules", f"good={tmp_path / 'good'}"])
    frontend = next(c for c in component_commands(args, str(tmp_path)) if c.name == "frontend")
    assert frontend.argv[frontend.argv.index("--max-lora-rank") + 1] == "8"  # the frontend checks the same rank
