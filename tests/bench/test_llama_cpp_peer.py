"""llama.cpp as a peer: a GGUF written from a tiny random Llama reads back as the same
model (pagedserve's converter; llama.cpp's greedy tokens), the runner yields exactly
max_tokens per request, `bench compare` shows its row, and `bench make-gguf` quantizes.

The llama.cpp tests need llama-cpp-python (scripts/install_llama_cpp_python.sh): its venv
at the default place, or PAGEDSERVE_LLAMA_CPP_PYTHON naming its python; they skip without.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.gguf_convert import GGUFModel, convert_gguf_to_hf
from common.model_files import smollm2_gguf_path
from pagedserve.bench.gguf_export import permute_rotary_rows, write_f32_gguf
from pagedserve.bench.make_gguf_cli import DEFAULT_LLAMA_CPP_PYTHON
from pagedserve.bench.workloads import BenchRequest, save_workload
from common.gguf_convert import unpermute_rotary_rows
from tiny_models import build_tiny_llama_with_smollm2_tokenizer, hf_greedy

REPO = Path(__file__).resolve().parents[2]
LLAMA_PYTHON = os.environ.get("PAGEDSERVE_LLAMA_CPP_PYTHON", DEFAULT_LLAMA_CPP_PYTHON)


def _llama_cpp_installed() -> bool:
    return os.path.exists(LLAMA_PYTHON) and subprocess.run(
        [LLAMA_PYTHON, "-c", "import llama_cpp"], capture_output=True, timeout=120).returncode == 0


needs_llama_cpp = pytest.mark.skipif(not _llama_cpp_installed(),
                                     reason=f"no llama-cpp-python at {LLAMA_PYTHON} "
                                            "(scripts/install_llama_cpp_python.sh)")
REQUESTS = [BenchRequest([(37 * i + 11 * j) % 49152 for j in range(5 + 7 * i)], 6 + 3 * i) for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, its float32 GGUF and a workload file."""
    root = tmp_path_factory.mktemp("llama_cpp")
    (root / "model").mkdir()
    model = build_tiny_llama_with_smollm2_tokenizer(  # not the default theta: the export must carry it
        root / "model", rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    write_f32_gguf(str(root / "model"), str(root / "tiny.gguf"), smollm2_gguf_path())
    save_workload(REQUESTS, str(root / "w.jsonl"))
    return root, model


def test_rotary_permutation_is_undone_by_the_converter():
    weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    permuted = permute_rotary_rows(weight, 4)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_rotary_rows(permuted, 4), weight)


def test_exported_gguf_converts_back_to_the_same_model(tiny, tmp_path):
    root, model = tiny
    gguf = GGUFModel(str(root / "tiny.gguf"))
    assert gguf.field("tokenizer.ggml.eos_token_id") == 2 and gguf.field("tokenizer.chat_template")
    out = convert_gguf_to_hf(str(root / "tiny.gguf"), str(tmp_path / "back"), progress=False)
    from safetensors.torch import load_file
    back = load_file(f"{out}/model.safetensors")
    state = model.state_dict()
    assert set(back) == set(state) - {"lm_head.weight"}  # tied: the embedding serves as lm_head
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(out)
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert model.config.rope_parameters["rope_theta"] == 50000.0


def llama_cpp(*args: str) -> dict:
    proc = subprocess.run([LLAMA_PYTHON, str(REPO / "pagedserve/bench/llama_cpp_runner.py"), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_llama_cpp
def test_runner_yields_max_tokens_of_the_models_greedy_choice(tiny):
    root, model = tiny
    result = llama_cpp("--model", str(root / "tiny.gguf"), "--workload", str(root / "w.jsonl"), "--threads", "2")
    assert result["system"] == "llama.cpp" and result["requests"] == 3 and result["threads"] == 2
    assert result["output_tokens"] == sum(r.max_tokens for r in REQUESTS)
    for request, first in zip(REQUESTS, result["first_tokens"]):  # llama.cpp reads the file as the model it is
        assert first == hf_greedy(model, request.prompt_token_ids, request.max_tokens)[:8]


@needs_llama_cpp
def test_compare_has_a_llama_cpp_row(tiny):
    root, _ = tiny
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "compare", "--workload",
                           str(root / "w.jsonl"), "--model", str(root / "tiny.gguf"), "--model-cache-dir",
                           str(root / "cache"), "--llama-cpp-python", LLAMA_PYTHON, "--skip-transformers",
                           "--no-detokenize", "--enforce-eager", "--dtype", "float32", "--kv-cache-memory",
                           "64MiB", "--chart", "", "--workload-dir", str(root)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "llama_cpp" in proc.stdout
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["llama_cpp_output_tokens_per_s"] > 0
    assert record["ratio_vs_llama_cpp"] == pytest.approx(
        record["pagedserve_output_tokens_per_s"] / record["llama_cpp_output_tokens_per_s"], rel=1e-3, abs=1e-3)


@needs_llama_cpp
def test_make_gguf_quantizes_with_llama_cpp(tiny, tmp_path):
    root, model = tiny
    out = tmp_path / "tiny-q8_0.gguf"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "make-gguf", "--type", "Q8_0",
                           "--model", str(root / "model"), "--tokenizer-gguf", smollm2_gguf_path(),
                           "--output", str(out), "--llama-cpp-python", LLAMA_PYTHON, "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tensor_types"]["Q8_0"] == 2 * 7 + 1  # every linear layer and the embedding; norms stay F32
    assert not list(tmp_path.glob(".make-gguf-*"))  # the float32 intermediate is gone
    state = model.state_dict()
    for name, weight in GGUFModel(str(out)).hf_tensors(4, 2):  # dequantized: close to the float32 weights
        reference = state[name].numpy()
        assert np.abs(weight - reference).max() <= np.abs(reference).max() / 100, name


def test_make_gguf_refuses_an_unknown_type(capsys):
    from pagedserve.bench.bench_cli import main

    assert main(["make-gguf", "--type", "Q3_X", "--output", "x.gguf"]) == 2
    assert "unknown --type 'Q3_X'" in capsys.readouterr().err
