"""`pagedserve bench chaos` end to end: a real `serve` (SmolLM2, float32, eager), mixed
requests (greedy and seeded, streamed and not, chat and completions, n = 2) while
component processes are SIGKILLed; no request may fail, every output must equal the
fault-free run's and every KV block must be free at the end. The short run is in the
default suite; the 10-minute one (the acceptance run of docs/operations.md, Chaos
soak) is marked slow."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from serve_helpers import REPO

# The kinds whose loss no request notices (the scheduler's since the frontend resubmits
# a lost scheduler's requests, issue 43): a kind to leave out is one edit here.
SURVIVED_KINDS = ["tokenizer", "router", "worker", "scheduler"]
LABELS = {"tokenizer": "tokenizer process", "router": "tokenizer router"}  # as the report names them
FAST_STACK = ["--enforce-eager", "--kv-cache-memory", "512MiB"]  # restarts in seconds


def run_chaos(tmp_path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    report_path = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "chaos", *FAST_STACK,
                           "--work-dir", str(tmp_path / "work"), "--output", str(report_path), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert report_path.exists(), proc.stderr[-4000:]
    return proc, json.loads(report_path.read_text())


def check(proc: subprocess.CompletedProcess, report: dict, kinds: list[str]) -> None:
    details = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert report["failed"] == 0, details
    assert report["mismatched"] == 0, details
    assert report["kv_blocks"]["all_free"], details
    assert not report["problems"], details
    assert report["completed"] > 0 and proc.returncode == 0, details
    assert {LABELS.get(k, k) for k in kinds} <= set(report["kills_per_kind"]), details
    assert all(kill["restarted_after_s"] is not None for kill in report["kills"]), details


@pytest.mark.slow  # 2 minutes; test_real_faults kills each component in the default run
@pytest.mark.parametrize("kinds", [SURVIVED_KINDS], ids=",".join)
def test_short_chaos_run_loses_and_changes_nothing(tmp_path, kinds):
    # 75 s of load, one kill of each kind 10-14 s apart (the next waits for the last
    # victim's replacement: a restarted tokenizer pool takes up to ~15 s on a busy
    # machine). Exactly one each: a request running through two worker deaths is
    # failed on purpose (the poison-request rule), and on a busy 2-core machine a
    # request can live that long.
    proc, report = run_chaos(tmp_path, "--duration", "75", "--concurrency", "4", "--kill-interval", "10,14",
                             "--max-kills", str(len(kinds)), "--max-tokens-range", "8,24",
                             "--kinds", ",".join(kinds), "--drain-wait", "30", timeout=720)
    check(proc, report, kinds)
    assert [kill["kind"] for kill in report["kills"]] == [LABELS.get(k, k) for k in kinds]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("kinds", [SURVIVED_KINDS], ids=",".join)
def test_ten_minute_chaos_soak(tmp_path, kinds):
    proc, report = run_chaos(tmp_path, "--duration", "600", "--kinds", ",".join(kinds), timeout=1400)
    check(proc, report, kinds)


def test_the_run_and_the_kv_block_check_on_a_model_free_stack(fast_stack):
    """No kills: every spec (chat and completions, streamed and not, n = 2) against the fake
    worker's scripted tokens completes and equals its reference; the blocks are all free."""
    import asyncio

    from pagedserve.bench.chaos import ChaosRun, ChaosSettings
    from pagedserve.bench.chaos_stack import ServeStack, kv_blocks_at_end
    from pagedserve.bench.chaos_workload import build_specs
    from tests.reliability.conftest import API_KEY

    stack = ServeStack(fast_stack.base_url, serve_pid=0, control_address=fast_stack.control_address,
                       api_key=API_KEY)
    settings = ChaosSettings(duration_s=2, concurrency=4, max_kills=0, drain_wait_s=10)
    report = asyncio.run(ChaosRun(stack, build_specs(max_tokens=(2, 6)), settings, log=lambda line: None).run())
    assert report["ok"] and report["completed"] > 0 and report["identical"] == report["completed"], report
    assert report["kills"] == [] and report["kv_blocks"]["all_free"]
    unreachable = kv_blocks_at_end("unix:/nonexistent/control", wait_s=0.5)
    assert not unreachable["all_free"] and unreachable["error"]
