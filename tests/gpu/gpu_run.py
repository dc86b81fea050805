"""The one-shot GPU run (started by tests/gpu/run_on_gpu.sh): stages, each a subprocess with
its own timeout inside an overall budget, results gathered into ONE JSON file.

Stages: the environment, the model (random weights in the default model's shape unless
--model gives a real one), the CUDA test subset (tests/gpu), `bench throughput` W1 and W2,
single-stream decode (S1) with CUDA graphs and with --enforce-eager, transformers `generate`
on the same GPU and W2, and decode attention's memory bandwidth. A stage that fails or times
out is recorded and the run goes on. Without CUDA (or with --dry-run) the CUDA stages are
recorded as skipped with the reason. Standard library only: it must start anywhere.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = REPO_ROOT / "tests" / "gpu"
BUNDLE = REPO_ROOT / "build" / "gpu-bundle"
TOTAL_BUDGET_S = 440  # the whole run stays under 8 minutes of GPU time
H200_BANDWIDTH_GBPS = 4800.0
STAGE_NAMES = ("environment", "model", "decode_bandwidth", "cuda_tests", "throughput_W1", "throughput_W2",
               "single_stream_graphs", "single_stream_eager", "hf_generate_W2")


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    needs_cuda: bool = True
    env: dict[str, str] = field(default_factory=dict)


def run_stage(stage: Stage, deadline: float, skip_reason: str | None = None) -> dict:
    """Run one stage; the record says ok / failed / timeout / skipped, its seconds, the last JSON
    line it printed (its result) and the tail of its stderr when it did not succeed."""
    if skip_reason:
        return {"status": "skipped", "reason": skip_reason}
    timeout = min(stage.timeout_s, deadline - time.monotonic())
    if timeout < 5:
        return {"status": "skipped", "reason": "the run's time budget is spent"}
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), str(GPU_TESTS)]),
           **stage.env}
    try:
        proc = subprocess.run(stage.argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"status": "timeout", "seconds": round(time.monotonic() - started, 2), "timeout_s": round(timeout, 1),
                "stderr_tail": stderr[-2000:]}
    except OSError as exc:
        return {"status": "failed", "seconds": 0.0, "reason": str(exc)}
    record = {"status": "ok" if proc.returncode == 0 else "failed", "seconds": round(time.monotonic() - started, 2),
              "returncode": proc.returncode, "result": last_json_line(proc.stdout)}
    if proc.returncode != 0:
        record["stderr_tail"] = (proc.stderr or proc.stdout)[-2000:]
    return record


def last_json_line(text: str) -> object:
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def junit_counts(path: Path) -> dict:
    """Passed / failed / skipped counts and the failing test ids from pytest's junit XML."""
    if not path.exists():
        return {}
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome in ("failure", "error"):
            counts["failed"] += 1
            counts["failures"].append(f"{case.get('classname')}::{case.get('name')}")
        elif outcome == "skipped":
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def build_stages(python: str, model_dir: Path, work: Path, given_model: bool) -> list[Stage]:
    engine = ["--model", str(model_dir), "--device", "cuda", "--attention-backend", "triton", "--dtype", "bfloat16",
              "--no-detokenize", "--json"]
    bench = [python, "-m", "pagedserve.cli", "bench", "throughput"]
    probe = ("import importlib, json, platform, torch; cuda = torch.cuda.is_available()\n"
             "def version(name):\n"
             "    try:\n"
             "        return importlib.import_module(name).__version__\n"
             "    except Exception as exc:\n"
             "        return f'unavailable: {exc}'\n"
             "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'triton': version('triton'), 'transformers': version('transformers'), "
             "'cuda_available': cuda, 'device': torch.cuda.get_device_name() if cuda else None}))")
    model_argv = ([python, "-c", f"print('{{\"given\": \"{model_dir}\"}}')"] if given_model
                  else [python, str(GPU_TESTS / "gpu_model.py"), str(BUNDLE / "model"), str(model_dir)])
    return [
        Stage("environment", [python, "-c", probe], 30, needs_cuda=False),
        Stage("model", model_argv, 50, needs_cuda=False),
        Stage("decode_bandwidth", [python, str(GPU_TESTS / "decode_bandwidth.py")], 25),
        Stage("cuda_tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                             f"--junitxml={work / 'cuda_tests.xml'}", str(GPU_TESTS / "test_triton_cuda.py"),
                             str(GPU_TESTS / "test_greedy_cuda.py")], 110,
              env={"PAGEDSERVE_GPU_MODEL": str(model_dir)}),
        # The first engine compiles the model step; later ones find inductor's cache warm.
        Stage("throughput_W1", bench + ["--workload", "W1"] + engine, 90),
        Stage("throughput_W2", bench + ["--workload", "W2"] + engine, 50),
        Stage("single_stream_graphs", bench + ["--workload", "S1"] + engine, 40),
        Stage("single_stream_eager", bench + ["--workload", "S1", "--enforce-eager"] + engine, 25),
        Stage("hf_generate_W2", [python, str(GPU_TESTS / "hf_generate_cuda.py"), "--model", str(model_dir),
                                 "--workload", "W2", "--dtype", "bfloat16"], 45),
    ]


def summarize(stages: dict[str, dict]) -> dict:
    def value(name: str, key: str) -> object:
        result = stages.get(name, {}).get("result")
        return result.get(key) if isinstance(result, dict) else None

    summary = {f"{name}_tokens_per_s": value(name, "output_tokens_per_s")
               for name in ("throughput_W1", "throughput_W2", "single_stream_graphs", "single_stream_eager",
                            "hf_generate_W2")}
    ours, theirs = summary["throughput_W2_tokens_per_s"], summary["hf_generate_W2_tokens_per_s"]
    summary["W2_speedup_over_hf_generate"] = round(ours / theirs, 2) if ours and theirs else None
    bandwidth = value("decode_bandwidth", "best_gb_per_s")
    summary["decode_attention_gb_per_s"] = bandwidth
    summary["decode_attention_fraction_of_h200"] = round(bandwidth / H200_BANDWIDTH_GBPS, 3) if bandwidth else None
    summary["cuda_tests"] = {k: v for k, v in (stages.get("cuda_tests", {}).get("result") or {}).items()}
    summary["stages_ok"] = sorted(name for name, record in stages.items() if record["status"] == "ok")
    summary["stages_not_ok"] = sorted(name for name, record in stages.items() if record["status"] != "ok")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="probe the environment only; skip the other stages")
    parser.add_argument("--model", type=Path, default=None, help="a real model directory (default: random weights)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default: $OUT/gpu_run.json)")
    parser.add_argument("--pip", default="not run", help="what run_on_gpu.sh's wheel install did")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S)
    args = parser.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or REPO_ROOT / "build") / "gpu_run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="pagedserve-gpu-"))
    model_dir = args.model.resolve() if args.model else work / "model"
    report = {"started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "dry_run": args.dry_run, "python": sys.version.split()[0], "pip_install": args.pip,
              "model": {"path": str(model_dir), "random_weights": args.model is None}, "budget_s": args.budget_s,
              "stages": {}}
    cuda = False
    for stage in build_stages(sys.executable, model_dir, work, args.model is not None):
        skip = None
        if args.dry_run and stage.name != "environment":
            skip = "dry run"
        elif stage.needs_cuda and not cuda:
            skip = "no CUDA device (torch.cuda.is_available() is False)"
        elif stage.name not in ("environment", "model") and report["stages"]["model"]["status"] != "ok":
            skip = "no model: the model stage did not succeed"
        record = run_stage(stage, deadline, skip)
        if stage.name == "environment":
            cuda = bool(isinstance(record.get("result"), dict) and record["result"].get("cuda_available"))
        if stage.name == "cuda_tests" and record["status"] != "skipped":
            record["result"] = junit_counts(work / "cuda_tests.xml")
        report["stages"][stage.name] = record
        out.write_text(json.dumps(report, indent=1))  # partial results survive a killed run
        print(f"[gpu_run] {stage.name}: {record['status']} {record.get('seconds', '')}", file=sys.stderr, flush=True)
    report["summary"] = summarize(report["stages"])
    report["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out.write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)  # the random model (0.5 GB) and the junit file
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
