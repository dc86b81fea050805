"""Hub ids (`ORG/NAME[@REVISION]`) resolved through huggingface_hub from a real cache
layout in a temporary HF_HOME, offline: nothing here downloads (no Hub is reachable)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from hub_cache import add_hub_model_dir, add_hub_snapshot, repo_cache_dir
from tiny_models import build_tiny_hf_model

from common.config import EngineConfig
from common.errors import ConfigError
from common.hub_models import hub_cache_dir, parse_hub_id
from common.model_files import (converted_dir_name, gguf_source_path, local_model_source, model_display_name,
                                resolve_model_dir, resolve_tokenizer_dir, smollm2_gguf_path)

REPO_ID = "tiny-org/tiny-llama"
GGUF_REPO_ID = "tiny-org/SmolLM2-GGUF"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """A Hub cache with REPO_ID at main (seed 0) and at tag v2 (seed 1), a repository whose
    model needs code we do not have, and a GGUF repository holding the SmolLM2 GGUF."""
    home = tmp_path_factory.mktemp("hf-home")
    commits = {}
    for ref, seed in (("main", 0), ("v2", 1)):
        source = tmp_path_factory.mktemp(f"model-{ref}")
        build_tiny_hf_model("LlamaForCausalLM", source, seed=seed)
        commits[ref] = add_hub_model_dir(home, REPO_ID, source, refs=(ref,))
    add_hub_snapshot(home, GGUF_REPO_ID, {GGUF_NAME: smollm2_gguf_path()})
    return SimpleNamespace(home=home, commits=commits)


@pytest.fixture()
def offline(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home.home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def snapshot(hub, repo_id: str, commit: str) -> str:
    return str(repo_cache_dir(hub.home, repo_id) / "snapshots" / commit)


def test_hub_ids_are_recognised():
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_hub_id("meta-llama/Llama-3.2-1B@main") == ("meta-llama/Llama-3.2-1B", "main")
    assert parse_hub_id("org/name@0123abcd") == ("org/name", "0123abcd")
    for not_an_id in ("/abs/path", "./org/name", "~/models/x", "a/b/c", "org/model.gguf", "smollm2", "org/", "/x"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_a_cached_model_resolves_offline_at_each_revision(offline):
    main, v2 = offline.commits["main"], offline.commits["v2"]
    assert hub_cache_dir() == str(offline.home / "hub")
    assert resolve_model_dir(REPO_ID) == snapshot(offline, REPO_ID, main)
    assert resolve_model_dir(f"{REPO_ID}@v2") == snapshot(offline, REPO_ID, v2)
    assert resolve_model_dir(REPO_ID, revision="v2") == snapshot(offline, REPO_ID, v2)
    assert resolve_model_dir(REPO_ID, revision=v2) == snapshot(offline, REPO_ID, v2)  # a commit hash
    with pytest.raises(ConfigError, match="names revision 'v2' but --revision is 'main'"):
        resolve_model_dir(f"{REPO_ID}@v2", revision="main")


def test_the_engine_and_tokenizer_get_local_paths(offline):
    pinned = local_model_source(EngineConfig(model=REPO_ID, revision="v2", device="cpu"))
    assert (pinned.model, pinned.revision) == (snapshot(offline, REPO_ID, offline.commits["v2"]), None)
    assert local_model_source(pinned) == pinned  # already local: nothing to do
    assert resolve_tokenizer_dir(f"{REPO_ID}@v2") == pinned.model


def test_served_name_of_a_hub_id_drops_the_revision():
    assert model_display_name("tiny-org/tiny-llama@v2") == "tiny-org/tiny-llama"
    assert model_display_name("tiny-org/tiny-llama") == "tiny-org/tiny-llama"


def test_a_local_directory_spelled_like_a_hub_id_wins(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / REPO_ID
    local.mkdir(parents=True)
    build_tiny_hf_model("LlamaForCausalLM", local, seed=5)
    assert resolve_model_dir(REPO_ID) == str(local)
    assert local_model_source(EngineConfig(model=REPO_ID, device="cpu")).model == REPO_ID  # left as given


@pytest.mark.parametrize("model, revision, cause", [
    ("nobody/not-cached", None, "HF_HUB_OFFLINE is set and it is not in the cache"),
    (REPO_ID, "no-such-branch", "HF_HUB_OFFLINE is set and it is not in the cache"),
])
def test_an_uncached_model_offline_is_one_clear_line(offline, model, revision, cause):
    with pytest.raises(ConfigError) as info:
        resolve_model_dir(model, revision=revision)
    message = str(info.value)
    assert message.startswith(f"cannot get model {model!r}") and cause in message, message
    assert str(offline.home / "hub") in message and "\n" not in message


def test_a_gguf_file_of_a_hub_repository(offline):
    cache = None  # the default, where tiny_models converted the SmolLM2 GGUF: reused, the same content
    cached_gguf = os.path.join(snapshot(offline, GGUF_REPO_ID, os.listdir(
        repo_cache_dir(offline.home, GGUF_REPO_ID) / "snapshots")[0]), GGUF_NAME)
    assert gguf_source_path(GGUF_REPO_ID, gguf_file=GGUF_NAME) == cached_gguf
    converted = resolve_model_dir(GGUF_REPO_ID, cache, gguf_file=GGUF_NAME)
    assert os.path.basename(converted) == converted_dir_name(smollm2_gguf_path())
    pinned = local_model_source(EngineConfig(model=GGUF_REPO_ID, gguf_file=GGUF_NAME, device="cpu"))
    assert (pinned.model, pinned.gguf_file) == (cached_gguf, None)
    with pytest.raises(ConfigError, match="no such file in the cache"):
        resolve_model_dir(GGUF_REPO_ID, cache, gguf_file="other.Q8_0.gguf")
    with pytest.raises(ConfigError, match="must be the name of a .gguf file"):
        resolve_model_dir(GGUF_REPO_ID, cache, gguf_file="../../etc/passwd.gguf")
    with pytest.raises(ConfigError, match="has no config.json; .*pass --gguf-file"):
        resolve_model_dir(GGUF_REPO_ID, cache)
