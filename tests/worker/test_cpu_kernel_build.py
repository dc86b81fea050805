"""A kernel build killed midway must not make later worker starts wait forever,
and two processes starting at once must not build over each other."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

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
