"""Smoke run of `pagedserve bench serving` against a real `pagedserve serve` (format, not speed)."""
from __future__ import annotations

import json
import subprocess
import sys

from pagedserve.bench.workloads import BenchRequest, save_workload
from serve_helpers import REPO, Server, metric_samples


def bench_serving(server: Server, workload, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "bench", "serving", "--base-url", server.base_url, "--rate", "20",
         "--workload", str(workload), "--json", "--no-progress", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_serving_benchmark_streams_every_request(tmp_path):
    workload = tmp_path / "w.jsonl"
    # Prompts of 20-26 tokens: one full 16-token block each for the prefix cache.
    requests = [BenchRequest([100 + 17 * i + j for j in range(20 + 2 * i)], 6) for i in range(4)]
    save_workload(requests, str(workload))
    server = Server(tmp_path, ["--enforce-eager", "--max-num-seqs", "8", "--block-size", "16"])
    try:
        server.wait_ready()
        result = bench_serving(server, workload, "--num-requests", "6")
        # A rerun sends a fresh cache salt: the seeded prompts are not served from the prefix
        # cache, which `--cache-salt none` (the same prompts twice) shows that they would be.
        hits = [metric_samples(server)["pagedserve:prefix_cache_hits_total"]]
        for salt in ("none", "none", "random"):
            rerun = bench_serving(server, workload, "--num-requests", "4", "--cache-salt", salt)
            assert rerun["completed"] == 4 and (rerun["cache_salt"] is None) == (salt == "none")
            hits.append(metric_samples(server)["pagedserve:prefix_cache_hits_total"])
    finally:
        server.stop()
    assert result["cache_salt"].startswith("bench-")
    assert hits[1] == hits[0], "a run without salt found a salted run's prompts"
    assert hits[2] == hits[1] + 4 * 16, "the unsalted rerun should hit one block per prompt"
    assert hits[3] == hits[2], "the salted rerun hit the prefix cache"
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_tokens"] == 36  # 6 requests (the workload repeated) x 6 tokens, ignore_eos
    assert result["rate"] == 20.0 and result["workload"] == "w.jsonl"
    for name in ("ttft", "itl", "e2e"):
        assert 0 < result[f"{name}_p50_ms"] <= result[f"{name}_p90_ms"] <= result[f"{name}_p99_ms"]
    assert result["ttft_p50_ms"] < result["e2e_p50_ms"]
    assert result["output_tokens_per_s"] > 0 and result["total_tokens_per_s"] > result["output_tokens_per_s"]

    human = subprocess.run(
        [sys.executable, "-c", "from pagedserve.bench.serving import format_serving; import json, sys; "
         "print(format_serving(json.loads(sys.argv[1])))", json.dumps(result)],
        cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "time to first token" in human and "p99" in human
