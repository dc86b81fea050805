"""Freed activation memory stays mapped after `keep_freed_memory_mapped` (glibc on Linux)."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
glibc_only = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

# A step's worth of activations through malloc (which torch's CPU allocator calls): 24 blocks of
# 4 MB written and freed. After the first cycles glibc's dynamic threshold serves them from the
# heap, whose top it then trims back to the kernel. The minor page faults of ten more cycles, of
# this thread only: an engine's own threads (the grammar warm-up, OpenMP) fault pages meanwhile.
CYCLES = """
import ctypes, ctypes.util, resource, sys
from worker.heap_tuning import keep_freed_memory_mapped
if sys.argv[1] == "tuned":
    assert keep_freed_memory_mapped()
elif sys.argv[1] == "cpu-engine":  # a CPU worker sets it up itself
    import tempfile
    from pathlib import Path
    sys.path.insert(0, "tests")
    from tiny_models import tiny_llama_engine
    with tempfile.TemporaryDirectory() as directory:
        engine = tiny_llama_engine(Path(directory), enforce_eager=True)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 4 << 20
def cycle():
    blocks = [libc.malloc(SIZE) for _ in range(24)]
    for block in blocks:
        ctypes.memset(block, 1, SIZE)
    for block in reversed(blocks):
        libc.free(block)
cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
for _ in range(10):
    cycle()
print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CYCLES, mode], cwd=REPO, check=True, capture_output=True,
                         text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_heap_pages_are_reused_without_faults():
    default, tuned = _faults("default"), _faults("tuned")
    # Under the defaults the heap's top goes back to the kernel each cycle: ~24k faults a cycle,
    # every page of the 96 MB; kept mapped, the pages are written again without a fault.
    assert default > 100_000, default
    assert tuned < 1_000, tuned


@glibc_only
def test_a_cpu_worker_keeps_freed_memory_mapped():
    assert _faults("cpu-engine") < 1_000


def test_off_glibc_it_reports_not_applied(monkeypatch):
    import worker.heap_tuning as heap_tuning

    monkeypatch.setattr(heap_tuning.sys, "platform", "darwin")
    assert heap_tuning.keep_freed_memory_mapped() is False
