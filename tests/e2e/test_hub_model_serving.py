"""Every entry point takes a Hub id: from a real Hub cache layout in a temporary HF_HOME,
with HF_HUB_OFFLINE=1 (nothing downloads; no Hub is reachable here). The offline LLM and
`pagedserve serve` generate what transformers generates with the same weights; a missing
model, an unreachable Hub or an architecture we do not implement is one line and exit 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import openai
import pytest
from hub_cache import add_hub_model_dir
from local_ports import free_port
from serve_helpers import REPO, running_server
from tiny_models import build_tiny_llama_with_smollm2_tokenizer, hf_greedy

REPO_ID = "tiny-org/chat-llama"
WEIGHTS_ONLY_ID = "tiny-org/weights-only"  # REPO_ID's main weights without tokenizer files
CUSTOM_ID = "tiny-org/custom-code-llm"
PROMPT = "The capital of France is"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """HF_HOME with REPO_ID at main and at tag v2 (other weights), WEIGHTS_ONLY_ID, and
    CUSTOM_ID, a model whose architecture only its own (remote) code would implement."""
    home = tmp_path_factory.mktemp("hf-home")
    models, sources = {}, {}
    for ref, seed in (("main", 0), ("v2", 1)):
        source = sources[ref] = tmp_path_factory.mktemp(f"chat-llama-{ref}")
        models[ref] = build_tiny_llama_with_smollm2_tokenizer(source, seed=seed)
        add_hub_model_dir(home, REPO_ID, source, refs=(ref,))
    custom = tmp_path_factory.mktemp("custom")
    shutil.copy(source / "model.safetensors", custom / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["MyCustomForCausalLM"], model_type="my_custom",
                  auto_map={"AutoModelForCausalLM": "modeling_custom.MyCustomForCausalLM"})
    (custom / "config.json").write_text(json.dumps(config))
    add_hub_model_dir(home, CUSTOM_ID, custom)
    weights = tmp_path_factory.mktemp("weights-only")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(sources["main"] / name, weights / name)
    add_hub_model_dir(home, WEIGHTS_ONLY_ID, weights)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    return home, models, tokenizer.encode(PROMPT)


def offline_env(home) -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def run_cli(args: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def test_offline_llm_generates_from_a_hub_id_at_each_revision(hub, monkeypatch):
    from common.sampling_params import SamplingParams
    from pagedserve.offline.llm import LLM

    home, models, prompt_ids = hub
    for name, value in offline_env(home).items():
        monkeypatch.setenv(name, value)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    settings = dict(dtype="float32", device="cpu", attention_backend="torch", enforce_eager=True,
                    kv_cache_memory=64 << 20, trust_remote_code=True)
    for ref, revision in (("main", None), ("v2", "v2")):
        llm = LLM(model=REPO_ID, revision=revision, **settings)
        output = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
        assert list(output.token_ids) == hf_greedy(models[ref], prompt_ids, NEW_TOKENS), ref
    assert hf_greedy(models["main"], prompt_ids, NEW_TOKENS) != hf_greedy(models["v2"], prompt_ids, NEW_TOKENS)


def test_a_tokenizer_from_another_hub_repository(hub, monkeypatch):
    from common.sampling_params import SamplingParams
    from pagedserve.offline.llm import LLM

    home, models, prompt_ids = hub
    for name, value in offline_env(home).items():
        monkeypatch.setenv(name, value)
    llm = LLM(model=WEIGHTS_ONLY_ID, tokenizer=REPO_ID, tokenizer_revision="v2", dtype="float32", device="cpu",
              attention_backend="torch", enforce_eager=True, kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    output = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    # The prompt text was encoded by REPO_ID's tokenizer (the weights-only repository has none).
    assert list(output.token_ids) == hf_greedy(models["main"], prompt_ids, NEW_TOKENS)


@pytest.mark.parametrize("model, tokenizer, ref", [(f"{REPO_ID}@v2", [], "v2"),
                                                   (WEIGHTS_ONLY_ID, ["--tokenizer", REPO_ID], "main")])
def test_serve_a_hub_id(hub, tmp_path, model, tokenizer, ref):
    home, models, prompt_ids = hub
    args = ["--model", model, *tokenizer, "--enforce-eager", "--tokenizer-pool-size", "1"]
    served = model.split("@")[0]  # vLLM's name: the id without @revision
    with running_server(tmp_path, args, env=offline_env(home)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == [served]
        reply = client.completions.create(model=served, prompt=PROMPT, temperature=0, max_tokens=NEW_TOKENS,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = reply.choices[0]
        assert choice.model_extra["prompt_token_ids"] == prompt_ids
        assert choice.model_extra["token_ids"] == hf_greedy(models[ref], prompt_ids, NEW_TOKENS)
        # Every component loaded the snapshot the launcher resolved; none asked the Hub.
        assert f"models--{served.replace('/', '--')}/snapshots/" in server.log()


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0", "--grpc-port", "0"],
                                     ["bench", "throughput"], ["frontend", "--port", "0", "--grpc-port", "0"]])
def test_an_uncached_model_offline_is_one_line_and_exit_2(hub, command):
    code, output = run_cli([*command, "--model", "nobody/not-cached@v1"], offline_env(hub[0]))
    assert code == 2, output
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
    assert "'nobody/not-cached' (revision 'v1')" in output and "HF_HUB_OFFLINE is set" in output, output


def test_an_unreachable_hub_is_one_line_and_exit_2(hub):
    env = {**offline_env(hub[0]), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    code, output = run_cli(["generate", "--prompt", "hi", "--model", "nobody/anything"], env)
    assert code == 2, output
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
    assert "'nobody/anything'" in output and "the Hub cannot be reached" in output, output


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0", "--grpc-port", "0"]])
def test_trust_remote_code_runs_no_code_and_names_the_supported_architectures(hub, command):
    code, output = run_cli([*command, "--model", CUSTOM_ID, "--trust-remote-code", "--device", "cpu"],
                           offline_env(hub[0]))
    assert code == 2, output
    assert "Traceback" not in output, output
    error = output.splitlines()[-1]
    assert "unsupported model architecture 'MyCustomForCausalLM'" in error, output
    assert "LlamaForCausalLM" in error and "Qwen2ForCausalLM" in error, output
