"""Smoke run of `pagedserve bench serving` against a real `pagedserve serve` (format, not speed)."""
from __future__ import annotations

import json
import subprocess
import sys

from common.benchmarks.workloads import BenchRequest, save_workload
from serve_helpers import REPO, Server


def test_serving_benchmark_streams_every_request(tmp_path):
    workload = tmp_path / "w.jsonl"
    requests = [BenchRequest([100 + 17 * i + j for j in range(5 + 2 * i)], 6) for i in range(4)]
    save_workload(requests, str(workload))
    server = Server(tmp_path, ["--enforce-eager", "--max-num-seqs", "8"])
    try:
        server.wait_ready()
        proc = subprocess.run(
            [sys.executable, "-m", "common.cli", "bench", "serving", "--base-url", server.base_url, "--rate", "20",
             "--num-requests", "6", "--workload", str(workload), "--json", "--no-progress"],
            cwd=REPO, capture_output=True, text=True, timeout=180)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_tokens"] == 36  # 6 requests (the workload repeated) x 6 tokens, ignore_eos
    assert result["rate"] == 20.0 and result["workload"] == "w.jsonl"
    for name in ("ttft", "itl", "e2e"):
        assert 0 < result[f"{name}_p50_ms"] <= result[f"{name}_p90_ms"] <= result[f"{name}_p99_ms"]
    assert result["ttft_p50_ms"] < result["e2e_p50_ms"]
    assert result["output_tokens_per_s"] > 0 and result["total_tokens_per_s"] > result["output_tokens_per_s"]

    human = subprocess.run(
        [sys.executable, "-c", "from common.benchmarks.serving import format_serving; import json, sys; "
         "print(format_serving(json.loads(sys.argv[1])))", json.dumps(result)],
        cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "time to first token" in human and "p99" in human
