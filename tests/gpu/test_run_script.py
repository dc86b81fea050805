"""The GPU run's plumbing, on any machine: run_on_gpu.sh parses and, with --dry-run, writes
the JSON report with every stage; a failing or hanging stage is recorded and the run goes on;
the bundle holds what the GPU run imports beyond torch, triton and transformers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import gpu_bundle
import gpu_run

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tests" / "gpu" / "run_on_gpu.sh"


def test_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_dry_run_writes_one_json_with_every_stage(tmp_path) -> None:
    out = tmp_path / "gpu_run.json"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "unused")}
    proc = subprocess.run([str(SCRIPT), "--dry-run", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert {"started_utc", "finished_utc", "dry_run", "python", "pip_install", "model", "budget_s", "stages",
            "summary"} <= set(report)
    assert report["dry_run"] is True and report["python"] == "%d.%d.%d" % sys.version_info[:3]
    assert tuple(report["stages"]) == gpu_run.STAGE_NAMES
    environment = report["stages"]["environment"]
    assert environment["status"] == "ok"
    assert {"python", "torch", "triton", "transformers", "cuda_available"} <= set(environment["result"])
    for name in gpu_run.STAGE_NAMES[1:]:
        assert report["stages"][name] == {"status": "skipped", "reason": "dry run"}
    summary = report["summary"]
    assert {"throughput_W1_tokens_per_s", "throughput_W2_tokens_per_s", "single_stream_graphs_tokens_per_s",
            "single_stream_eager_tokens_per_s", "hf_generate_W2_tokens_per_s", "W2_speedup_over_hf_generate",
            "decode_attention_gb_per_s", "decode_attention_fraction_of_h200", "cuda_tests"} <= set(summary)
    assert summary["stages_ok"] == ["environment"]


def test_a_failed_or_hung_stage_is_recorded() -> None:
    deadline = time.monotonic() + 60
    failed = gpu_run.run_stage(gpu_run.Stage("f", [sys.executable, "-c", "print('{\"a\": 1}'); raise SystemExit(3)"],
                                             30), deadline)
    assert failed["status"] == "failed" and failed["returncode"] == 3 and failed["result"] == {"a": 1}
    hung = gpu_run.run_stage(gpu_run.Stage("h", [sys.executable, "-c", "import time; time.sleep(30)"], 6), deadline)
    assert hung["status"] == "timeout" and hung["seconds"] < 20
    assert gpu_run.run_stage(gpu_run.Stage("late", ["true"], 30), time.monotonic() + 1)["status"] == "skipped"


def _distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_bundle_holds_what_the_gpu_run_imports_beyond_the_preinstalled() -> None:
    assert gpu_bundle.PYTHON_VERSIONS == ("3.10", "3.11", "3.12", "3.13")
    assert not set(gpu_bundle.REQUIREMENTS) & set(gpu_bundle.PREINSTALLED)
    # The distributions behind every third-party module the GPU run's code imports.
    probe = (
        "import sys, json, importlib.metadata as md\n"
        "import pagedserve.cli, pagedserve.bench.bench_cli, pagedserve.bench.throughput, pagedserve.offline.llm\n"
        "import pagedserve.bench.hf_baseline, worker.worker, worker.model_runner, worker.attention.triton_backend\n"
        "import pytest, gpu_run, gpu_model, hf_generate_cuda\n"
        "owners = md.packages_distributions()\n"
        "tops = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
        "print(json.dumps(sorted({d for t in tops for d in owners.get(t, [])})))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO_ROOT / p) for p in ("", "tests", "tests/gpu"))}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported = {_distribution(d) for d in json.loads(proc.stdout)} - {"pagedserve"}
    from importlib import metadata
    provided, todo = set(), [*gpu_bundle.PREINSTALLED, *gpu_bundle.REQUIREMENTS]
    while todo:  # the bundled and preinstalled distributions with all their dependencies
        name = _distribution(todo.pop())
        if name in provided:
            continue
        provided.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r]
    assert "msgspec" in imported and "pyzmq" in imported  # the probe saw the engine's imports
    assert imported <= provided, f"not bundled: {sorted(imported - provided)}"


def test_make_target_builds_the_bundle() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-bundle:.*\n\t.*tests/gpu/gpu_bundle.py build/gpu-bundle", makefile, re.M)
    assert "build/" in (REPO_ROOT / ".gitignore").read_text().split()
