"""A kernel build killed midway must not make later worker starts wait forever,
two processes starting at once must not build over each other, and the source
compiles for CPUs other than this one."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from worker.attention import cpu_kernels

# A builder that takes the guard, leaves torch's lock file as a build in progress does, and hangs.
_HANGING_BUILDER = """
import sys, time
from pathlib import Path
from worker.attention import cpu_kernels
name = sys.argv[1]
with cpu_kernels._exclusive_build(name):
    Path(sys.argv[2], name, "lock").write_text("")
    print("building", flush=True)
    time.sleep(600)
"""


def _enter_guard_in_thread(name: str) -> tuple[threading.Thread, threading.Event]:
    entered = threading.Event()

    def run() -> None:
        with cpu_kernels._exclusive_build(name):
            entered.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, entered


def test_a_killed_builders_lock_file_is_removed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_kernels._extension_name()
    lock = tmp_path / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # left a second ago by a build that was killed
    with cpu_kernels._exclusive_build(name):
        assert not lock.exists()


def test_a_live_build_is_waited_for_and_a_killed_one_is_not(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_kernels._extension_name()
    builder = subprocess.Popen([sys.executable, "-c", _HANGING_BUILDER, name, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "building"
        thread, entered = _enter_guard_in_thread(name)
        assert not entered.wait(1.5), "entered while another process was building"
        assert (tmp_path / name / "lock").exists()
        builder.send_signal(signal.SIGKILL)  # killed midway: its lock file stays, its flock goes
        builder.wait(10)
        assert entered.wait(10), "still waiting for a build that was killed"
        thread.join(10)
        assert not (tmp_path / name / "lock").exists()
    finally:
        builder.kill()
        builder.wait()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("features", [["-mavx512bf16"], ["-mno-avx512f"]], ids=["avx512bf16", "no_avx512"])
def test_the_source_compiles_for_cpus_other_than_this_one(features: list[str]) -> None:
    """The AVX512-BF16 paths (transposed bf16 scoring, bf16 matmuls) and the portable loops
    run only on other CPUs: compile them here too, so that a change cannot break them unseen."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    result = subprocess.run(["g++", "-x", "c++", "-std=c++20", "-fsyntax-only", "-w", *cpu_kernels.CFLAGS,
                             *features, *includes, "-"],
                            input=cpu_kernels.SOURCE, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
