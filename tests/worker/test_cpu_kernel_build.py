"""A kernel build killed midway must not make every later worker start wait forever."""
from __future__ import annotations

import os
import time

from worker.attention import cpu_kernels


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_kernels._extension_name()
    build_dir = tmp_path / name
    build_dir.mkdir(parents=True)
    lock = build_dir / "lock"
    lock.write_text("")
    cpu_kernels._clear_stale_build_lock(name)
    assert lock.exists(), "a build that is running now holds a fresh lock"
    old = time.time() - cpu_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_kernels._clear_stale_build_lock(name)
    assert not lock.exists()
    cpu_kernels._clear_stale_build_lock(name)  # no lock at all: nothing to do
