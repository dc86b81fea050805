"""The shared-memory all-reduce of tensor-parallel ranks on one host, against a plain sum.

Two real processes (a gloo group for the set-up) each reduce seeded tensors of
several shapes and dtypes many times in a row (the two buffers alternate); every
result must be the sum computed here, in rank order, bit for bit. A peer that
dies mid-collective must make the other raise, not spin forever.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from local_ports import free_port
from serve_helpers import REPO

RANK_SCRIPT = r"""
import json, os, sys, torch, torch.distributed as dist
from worker.distributed.shm_all_reduce import ShmAllReduce
rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
reduce = ShmAllReduce(None, [0, 1], rank)
if mode == "die" and rank == 1:
    os._exit(0)
sums = []
try:
    for call, (shape, dtype) in enumerate([((3, 5), torch.float32), ((1, 576), torch.bfloat16),
                                           ((64, 576), torch.float32), ((7,), torch.bfloat16)] * 3):
        generator = torch.Generator().manual_seed(1000 * call + rank)
        x = torch.randn(shape, generator=generator).to(dtype)
        sums.append(reduce(x).float().flatten().tolist())
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
if rank == 0:
    print(json.dumps({"sums": sums}))
"""


def run_pair(mode: str) -> dict:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), port, mode], cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    out = procs[0].communicate(timeout=120)[0]
    procs[1].communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def test_every_call_is_the_rank_ordered_sum():
    sums = run_pair("reduce")["sums"]
    for call, ((shape, dtype), got) in enumerate(zip([((3, 5), torch.float32), ((1, 576), torch.bfloat16),
                                                       ((64, 576), torch.float32), ((7,), torch.bfloat16)] * 3, sums)):
        parts = [torch.randn(shape, generator=torch.Generator().manual_seed(1000 * call + rank)).to(dtype)
                 for rank in (0, 1)]
        assert got == (parts[0].clone() + parts[1]).float().flatten().tolist(), call


def test_a_dead_peer_raises_instead_of_waiting_forever():
    started = time.monotonic()
    result = run_pair("die")
    assert "is gone" in result["error"]
    assert time.monotonic() - started < 60
