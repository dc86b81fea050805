"""`bench perplexity`: the engine's perplexity equals transformers' on the same windows,
variants run side by side in their own processes, and bad variants are refused."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.bench.perplexity import DEFAULT_TEXT, parse_tolerance, parse_variant, sliding_windows
from tiny_models import build_tiny_llama_with_smollm2_tokenizer

REPO = Path(__file__).resolve().parents[2]
MEASURE = ["--window", "96", "--stride", "40", "--max-text-tokens", "300"]
ENGINE = ["--kv-cache-memory", "64MiB", "--enforce-eager"]


def bench(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "perplexity", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ppl") / "model"
    directory.mkdir()
    model = build_tiny_llama_with_smollm2_tokenizer(directory)
    return directory, model


def reference_perplexity(model, token_ids: list[int], window: int, stride: int) -> float:
    """transformers' log-softmax over the same windows, each token scored once."""
    nll, count = 0.0, 0
    for w in sliding_windows(len(token_ids), window, stride):
        with torch.no_grad():
            logits = model(torch.tensor([token_ids[w.start:w.end]])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        for index in range(w.score_from, w.end):
            nll -= logprobs[index - w.start - 1, token_ids[index]].item()
            count += 1
    assert count == len(token_ids) - 1
    return math.exp(nll / count)


def test_windows_score_every_token_once_with_context():
    for n, window, stride in [(10, 4, 2), (1000, 96, 40), (7, 8, 4), (50, 10, 9)]:
        windows = sliding_windows(n, window, stride)
        scored = [i for w in windows for i in range(w.score_from, w.end)]
        assert scored == list(range(1, n))
        assert all(w.end - w.start <= window for w in windows)
        assert all(w.score_from - w.start >= window - stride for w in windows[1:])
    for bad in [(10, 1, 1), (10, 4, 4), (10, 4, 0), (1, 4, 2)]:
        with pytest.raises(ValueError):
            sliding_windows(*bad)


def test_variant_and_tolerance_parsing():
    assert parse_variant('int8=--dtype bfloat16 --quantization "int8"') == (
        "int8", ["--dtype", "bfloat16", "--quantization", "int8"])
    assert parse_variant("base=") == ("base", [])
    assert parse_tolerance("2%") == pytest.approx(0.02) and parse_tolerance("0.1") == 0.1
    for bad in ["no-equals-sign", "=--dtype float32", "a b=--dtype float32", 'x=--model "unclosed']:
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)
    for bad in ["two", "-1%"]:
        with pytest.raises(ValueError, match="tolerance"):
            parse_tolerance(bad)


def test_engine_perplexity_equals_transformers(tiny):
    directory, model = tiny
    [line] = bench("--model", str(directory), "--dtype", "float32", *MEASURE, *ENGINE, "--json").stdout.splitlines()
    result = json.loads(line)
    from transformers import AutoTokenizer
    token_ids = AutoTokenizer.from_pretrained(directory).encode(DEFAULT_TEXT.read_text(), add_special_tokens=False)
    assert len(token_ids) > 5000  # the shipped text is a few thousand tokens
    expected = reference_perplexity(model, token_ids[:300], 96, 40)
    assert result["scored_tokens"] == 299 and result["windows"] == len(sliding_windows(300, 96, 40))
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert result["perplexity"] > 1000  # a random model is far from the text: the check is not vacuous


def test_variants_run_side_by_side_with_ratios(tiny):
    directory, _ = tiny
    common = ["--model", str(directory), *MEASURE, *ENGINE]
    proc = bench(*common, "--variant", "f32=--dtype float32", "--variant", "bf16=--dtype bfloat16",
                 "--tolerance", "bf16=50%", "--json")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    f32, bf16 = report["variants"]
    assert (f32["variant"], f32["dtype"], f32["ratio"]) == ("f32", "float32", 1.0)
    assert bf16["dtype"] == "bfloat16" and bf16["flags"] == ["--dtype", "bfloat16"]
    assert bf16["ratio"] == pytest.approx(bf16["perplexity"] / f32["perplexity"], rel=1e-5)
    assert bf16["ratio"] != 1.0 and bf16["passed"] is True and f32["passed"] is None and report["passed"]

    proc = bench(*common, "--variant", "f32=--dtype float32", "--variant", "bf16=--dtype bfloat16",
                 "--tolerance", "bf16=0", expect=1)  # bfloat16 rounding moves the perplexity a little
    assert "FAIL" in proc.stdout and "ratios to f32" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--variant", "no-equals"], "expected NAME="),
    (["--variant", "a=--dtype float32", "--variant", "a=--dtype bfloat16"], "must differ"),
    (["--variant", "a=--no-such-flag"], "variant 'a': unrecognized arguments: --no-such-flag"),
    (["--variant", "a=--dtype float64"], "variant 'a': argument --dtype"),
    (["--variant", "a=--dtype float32", "--tolerance", "b=1%"], "--tolerance 'b=1%'"),
    (["--tolerance", "a=1%"], "applies to --variant"),
])
def test_bad_variants_are_refused_before_running(args, message, capsys):
    from pagedserve.bench.bench_cli import main

    assert main(["perplexity", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "running" not in err
