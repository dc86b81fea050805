"""The CPU kernel extension builds where it should, and a build that fails says where: a
failed build fails the suite (the kernel tests do not skip on it); a kernel build killed
midway must not make later worker starts wait forever, two processes starting at once must
not build over each other, and the sources compile for CPUs with AVX512-BF16 too."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from worker.kernels import cpu_extension

# A builder that takes the guard, leaves torch's lock file as a build in progress does, and hangs.
_HANGING_BUILDER = """
import sys, time
from pathlib import Path
from worker.kernels import cpu_extension
name = sys.argv[1]
with cpu_extension._exclusive_build(name):
    Path(sys.argv[2], name, "lock").write_text("")
    print("building", flush=True)
    time.sleep(600)
"""


def _enter_guard_in_thread(name: str) -> tuple[threading.Thread, threading.Event]:
    entered = threading.Event()

    def run() -> None:
        with cpu_extension._exclusive_build(name):
            entered.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, entered


@pytest.mark.skipif(not cpu_extension.expected(), reason="no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0")
def test_the_extension_builds_where_a_compiler_is_present() -> None:
    """With a compiler and the switch on, the kernels must load: a build failure is a bug
    (the kernel tests then fail too, rather than skip)."""
    assert cpu_extension.load() is not None, cpu_extension.failure()


def test_a_broken_source_fails_the_load_naming_its_file(tmp_path: Path, monkeypatch) -> None:
    """The loader's failure carries the compiler's error with the path of the broken .cpp, and
    the build goes to its own cache: the real one is untouched. One translation unit, broken
    at its first line, keeps this cheap."""
    if not cpu_extension.compiler_present():
        pytest.skip("no C++ compiler")
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for header in cpu_extension.CSRC.glob("*.h"):
        shutil.copy(header, csrc)
    broken = csrc / "kv_cache_write.cpp"
    broken.write_text('#include "no_such_kernel_header.h"  // deliberately broken\n'
                      + (cpu_extension.CSRC / broken.name).read_text())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv(cpu_extension.ENV_SWITCH, "1")
    monkeypatch.setattr(cpu_extension, "CSRC", csrc)
    monkeypatch.setattr(cpu_extension, "_module", None)
    monkeypatch.setattr(cpu_extension, "_failed", False)
    monkeypatch.setattr(cpu_extension, "_failure", None)
    assert cpu_extension.load() is None
    assert f"{broken}:1:" in cpu_extension.failure() and "no_such_kernel_header.h" in cpu_extension.failure()
    with pytest.raises(cpu_extension.KernelBuildError, match="no_such_kernel_header"):
        cpu_extension.require()


def test_the_cache_name_follows_every_source_file(tmp_path: Path) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_extension.CSRC, csrc)
    name = cpu_extension.extension_name(csrc=csrc)
    assert name == cpu_extension.extension_name(csrc=csrc)
    # Another checkout of the same sources builds apart: torch's build files name the paths.
    assert name != cpu_extension.extension_name(csrc=cpu_extension.CSRC)
    header = csrc / "vector_helpers.h"
    header.write_text(header.read_text() + "\n")
    assert cpu_extension.extension_name(csrc=csrc) != name
    assert cpu_extension.extension_name([*cpu_extension.CFLAGS, "-mno-avx512f"]) != cpu_extension.extension_name()


def test_a_killed_builders_lock_file_is_removed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_extension.extension_name()
    lock = tmp_path / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # left a second ago by a build that was killed
    with cpu_extension._exclusive_build(name):
        assert not lock.exists()


def test_a_live_build_is_waited_for_and_a_killed_one_is_not(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_extension.extension_name()
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
@pytest.mark.skipif("avx512_bf16" in cpu_extension._cpu_flags().split(),
                    reason="this CPU has AVX512-BF16: the extension's own build compiles those paths")
def test_the_sources_compile_for_cpus_with_avx512_bf16() -> None:
    """The AVX512-BF16 paths (transposed bf16 scoring, bf16 matmuls, the bf16 screen) run only
    on such CPUs: compile them here too, all the .cpp files in one translation unit (they do
    not clash), so that a change cannot break them unseen. The portable paths are built and run
    by test_cpu_kernels_portable."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in include_paths()] + [f"-I{sysconfig.get_paths()['include']}",
                                                             f"-I{cpu_extension.CSRC}"]
    unity = "".join(f'#include "{path.name}"\n' for path in cpu_extension.source_files())
    result = subprocess.run(["g++", "-x", "c++", "-std=c++20", "-fsyntax-only", "-w", "-DTORCH_EXTENSION_NAME=check",
                             *cpu_extension.CFLAGS, "-mavx512bf16", *includes, "-"],
                            input=unity, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
