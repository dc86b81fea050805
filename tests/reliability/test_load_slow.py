"""Load (slow, `pytest -m slow tests/reliability/test_load_slow.py`): 1000
concurrent streams against a real server, three times over. Every stream
completes without an error, every KV block is free after each round, and no
component's memory keeps growing from one round to the next."""
from __future__ import annotations

import resource

import pytest

from serve_helpers import MODEL, Server
from tests.reliability.clients import many_streams, scheduler_stats
from tests.reliability.stack import wait_all_blocks_free

NUM_STREAMS = 1000
ROUNDS = 3
ALLOWED_GROWTH_BYTES = 48 << 20  # allocator noise; a leak of even 50 KB per request would exceed it


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_by_component(server: Server) -> dict[str, int]:
    return {name: sum(rss_bytes(pid) for pid in pids) for name, pids in server.component_pids().items()}


@pytest.mark.slow
def test_1000_concurrent_streams_no_errors_no_leaks(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * NUM_STREAMS)), hard))
    server = Server(tmp_path, ["--kv-cache-memory", "512MiB", "--disable-log-stats", "--enforce-eager"])
    try:
        server.wait_ready()
        control = f"unix:{server.runtime_dir}/control"
        memory = []
        for round_index in range(ROUNDS):
            bodies = [{"model": MODEL, "prompt": f"Request {i} of round {round_index}:", "max_tokens": 8,
                       "temperature": 0, "ignore_eos": True} for i in range(NUM_STREAMS)]
            results = many_streams(server.base_url, bodies, timeout=1800)
            failures = [r for r in results if not r.ok]
            assert not failures, (len(failures), failures[:3])
            wait_all_blocks_free(lambda: scheduler_stats(control), timeout=10)
            memory.append(memory_by_component(server))
        for name in memory[0]:
            growth = memory[-1][name] - memory[1][name]  # after warm-up: steady state
            assert growth < ALLOWED_GROWTH_BYTES, (name, [m[name] >> 20 for m in memory])
    finally:
        server.stop()
